"""``trainer.checkpointing.emergency_save`` in one process: the configuration's checks (one-line
errors naming the key), and a job that signals itself: the save of the step, ``Preempted``
with the signal's code, the checkpoint's ``trigger``, the catalog event, ``zephon
checkpoints`` (table and --json), the handlers restored. The multi-rank runs with random
signals are in test_preemption.py."""

from __future__ import annotations

import json
import os
import signal

import pytest

import zephon
from zephon.catalog import Catalog
from zephon.emergency import EmergencySaveConfig

KEY = "trainer.checkpointing.emergency_save"


def job(tmp_path, emergency):
    return {
        "run": {"name": "r"},
        "trainer": {
            "total_steps": 9,
            "checkpointing": {"save_dir": str(tmp_path), "emergency_save": emergency},
        },
    }


def test_yaml_mapping_gives_the_dataclass_and_defaults(tmp_path):
    config = zephon.load_job_config(job(tmp_path, {"signals": ["SIGTERM", "SIGUSR1"]}))
    assert config.checkpointing.emergency_save == EmergencySaveConfig(
        signals=("SIGTERM", "SIGUSR1"), grace_s=30.0, when="step", prefix=KEY
    )
    off = zephon.load_job_config(job(tmp_path, None)).checkpointing
    assert off.emergency_save is None
    assert zephon.CheckpointingConfig(save_dir=str(tmp_path)).emergency_save is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"signals": ["SIGKILL"]}, f"{KEY}.signals = 'SIGKILL' is invalid: SIGKILL and SIGSTOP"),
        ({"signals": ["SIGSTOP"]}, f"{KEY}.signals = 'SIGSTOP' is invalid: SIGKILL and SIGSTOP"),
        ({"signals": ["SIGNOPE"]}, f"{KEY}.signals = 'SIGNOPE' is invalid: use signal names"),
        ({"signals": ["TERM"]}, f"{KEY}.signals = 'TERM' is invalid: use signal names"),
        ({"signals": "SIGTERM"}, f"{KEY}.signals = 'SIGTERM' is invalid: use a list"),
        ({"signals": []}, f"{KEY}.signals = () is invalid: use a list"),
        ({"grace_s": 0}, f"{KEY}.grace_s = 0 is invalid: use a number of seconds above 0"),
        ({"grace_s": -1}, f"{KEY}.grace_s = -1 is invalid"),
        ({"grace_s": "30"}, f"{KEY}.grace_s = '30' is invalid"),
        ({"grace_s": True}, f"{KEY}.grace_s = True is invalid"),
        ({"when": "later"}, f"{KEY}.when = 'later' is invalid: use \"step\" (the next step"),
        ({"when": "NOW"}, f"{KEY}.when = 'NOW' is invalid: use \"step\" (the next step"),
        ({"signal": ["SIGTERM"]}, f"{KEY}.signal is not a known setting; known: signals,"),
        ("SIGTERM", f"{KEY} = 'SIGTERM' is invalid: use a mapping"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(tmp_path, value, message):
    with pytest.raises(zephon.ConfigError) as raised:
        zephon.load_job_config(job(tmp_path, value))
    assert str(raised.value).startswith(message), str(raised.value)
    assert "\n" not in str(raised.value)


def test_preempted_exits_with_the_signals_conventional_code():
    preempted = zephon.Preempted("SIGTERM", 7, "s3://b/ckpt/r/save-7")
    assert isinstance(preempted, SystemExit)
    assert (preempted.code, preempted.signal, preempted.step) == (143, "SIGTERM", 7)
    assert zephon.Preempted("SIGINT", 1, "x").code == 130


@pytest.mark.parametrize("async_save", [False, True])
def test_a_signal_saves_the_next_step_marks_it_and_exits(
    tmp_path, catalog_url, cli, caplog, async_save
):
    import torch
    from torch import nn

    before = signal.getsignal(signal.SIGUSR1)
    config = zephon.CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        period_steps=4,
        catalog_url=catalog_url,
        async_save=async_save,
        emergency_save={"signals": ["SIGUSR1"], "grace_s": 60},
    )
    model = nn.Linear(2, 1)
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    saved = []
    manager = zephon.CheckpointManager(config, run_name="r", total_steps=9)
    with pytest.raises(zephon.Preempted) as raised, manager:
        for step in range(manager.load_latest(state).next_step, 10):
            if step == 6:
                os.kill(os.getpid(), signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGUSR1)  # a second: ignored
            saved.append(manager.maybe_save(step, state))
    assert saved == [False, False, False, True, False]  # step 6 raised instead
    preempted = raised.value
    url = f"{tmp_path}/ckpt/r/save-6"
    assert (preempted.code, preempted.step, preempted.url) == (128 + signal.SIGUSR1, 6, url)
    assert signal.getsignal(signal.SIGUSR1) == before  # restored at close
    lines = [r.getMessage() for r in caplog.records if "emergency save of" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("zephon: SIGUSR1: emergency save of step 6 committed in ")
    assert lines[0].endswith(f" s ({url}); exiting")
    with Catalog(catalog_url) as catalog:
        row = catalog.get_checkpoint("r", 6)
        assert row.state == "committed"
        assert row.metadata is not None
        assert (row.metadata["trigger"], row.metadata["signal"]) == ("emergency", "SIGUSR1")
        assert catalog.get_checkpoint("r", 4).metadata.get("trigger") is None
        events = [e for e in catalog.events(run="r") if e.action == "emergency_save"]
        assert [(e.step, e.detail["signal"], e.detail["url"]) for e in events] == [
            (6, "SIGUSR1", url)
        ]
    code, out, _ = cli("checkpoints", "r")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert "committed (emergency)" in rows["6"] and "emergency" not in rows["4"]
    code, out, _ = cli("checkpoints", "r", "--json")
    assert [(e["step"], e["trigger"]) for e in json.loads(out)] == [(4, None), (6, "emergency")]


def test_a_third_signal_goes_to_the_previous_handler(tmp_path, capfd):
    """The second signal is ignored, the third restores the handler that was there before and
    delivers the signal to it (a default handler would end the process); the flag stays set:
    the next step boundary still saves."""
    received = []
    before = signal.signal(signal.SIGUSR2, lambda number, frame: received.append(number))
    try:
        config = zephon.CheckpointingConfig(
            save_dir=str(tmp_path), emergency_save={"signals": ["SIGUSR2"]}
        )
        manager = zephon.CheckpointManager(config, run_name="r", total_steps=5)
        with pytest.raises(zephon.Preempted) as raised, manager:
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGUSR2)
            assert received == [signal.SIGUSR2]
            manager.maybe_save(1, {"value": 1})
        assert raised.value.step == 1
        err = capfd.readouterr().err
        assert "SIGUSR2 again: ignored while the emergency save completes" in err
        assert "SIGUSR2 a third time: passed on to the handler before Zephon's" in err
    finally:
        signal.signal(signal.SIGUSR2, before)
