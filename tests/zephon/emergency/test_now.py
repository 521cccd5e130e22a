"""``emergency_save.when: now`` in one process (``zephon.emergency_now``): the configuration,
the boundary snapshot (a copy, frozen while an emergency save runs, released one step further
for a rank behind), and a job that signals itself in the middle of a step: the checkpoint holds
the state of the last boundary, not the half-updated live state, and is marked emergency. The
process's end is replaced by a recorder here (pytest must live on); the real exit, on two gloo
ranks with SIGTERM at random moments, is in test_now_preemption.py."""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
from torch import nn

import zephon
from zephon.catalog import Catalog
from zephon.checkpointing.saver import PreparedState
from zephon.emergency import EmergencySaveConfig
from zephon.emergency_now import Snapshot

KEY = "trainer.checkpointing.emergency_save"


def test_when_now_is_accepted(tmp_path):
    config = zephon.load_job_config(
        {
            "run": {"name": "r"},
            "trainer": {
                "checkpointing": {
                    "save_dir": str(tmp_path),
                    "emergency_save": {"signals": ["SIGTERM"], "when": "now"},
                }
            },
        }
    )
    assert config.checkpointing.emergency_save == EmergencySaveConfig(
        signals=("SIGTERM",), grace_s=30.0, when="now", prefix=KEY
    )


def prepared(tensor: torch.Tensor, value: int) -> PreparedState:
    return PreparedState(layout=None, tensors={"t": tensor}, shared={"v": [value]}, own={})


def take_in_thread(snapshot: Snapshot, step: int, tensor: torch.Tensor) -> threading.Event:
    done = threading.Event()

    def take() -> None:
        snapshot.take(step, lambda: prepared(tensor, step), False)
        done.set()

    threading.Thread(target=take, daemon=True).start()
    return done


def test_the_snapshot_is_a_copy_and_frozen_while_an_emergency_save_runs():
    snapshot = Snapshot()
    live = torch.zeros(4)
    snapshot.take(1, lambda: prepared(live, 1), False)
    copied = snapshot.prepared
    assert copied is not None and snapshot.step == 1
    live.add_(1.0)  # the next step updates the live state in place
    assert torch.equal(copied.tensors["t"], torch.zeros(4))
    snapshot.take(2, lambda: prepared(live, 2), False)
    assert snapshot.prepared.tensors["t"] is copied.tensors["t"]  # the buffer is reused
    assert torch.equal(copied.tensors["t"], torch.ones(4))

    assert snapshot.freeze() == 2  # an emergency save of step 2 begins
    live.add_(1.0)
    done = take_in_thread(snapshot, 3, live)
    assert not done.wait(0.5)  # the boundary of step 3 waits: the buffers are being saved
    assert snapshot.step == 2 and torch.equal(copied.tensors["t"], torch.ones(4))
    assert snapshot.prepared.shared == {"v": [2]}
    snapshot.close()


def test_a_rank_behind_takes_one_snapshot_more_then_stays_frozen():
    snapshot = Snapshot()
    live = torch.zeros(2)
    snapshot.take(4, lambda: prepared(live, 4), False)
    assert snapshot.freeze() == 4
    live.add_(5.0)
    fifth = take_in_thread(snapshot, 5, live)  # its boundary of step 5, reached meanwhile
    assert snapshot.allow(5, timeout=30)  # another rank is at step 5: this one copies it too
    assert fifth.wait(30) and snapshot.step == 5
    assert torch.equal(snapshot.prepared.tensors["t"], torch.full((2,), 5.0))
    live.add_(1.0)
    sixth = take_in_thread(snapshot, 6, live)
    assert not sixth.wait(0.5)
    assert torch.equal(snapshot.prepared.tensors["t"], torch.full((2,), 5.0))
    snapshot.close()


def test_the_agreement_waits_for_the_periodic_save_of_the_boundary():
    snapshot = Snapshot()
    snapshot.take(3, lambda: prepared(torch.zeros(1), 3), True)  # a periodic save of 3 follows
    assert snapshot.freeze() == 3
    assert not snapshot.allow(3, timeout=0.2)  # it is under way
    snapshot.regular_done(ok=True)
    assert snapshot.allow(3, timeout=30) and snapshot.saved == 3
    snapshot.close()


def now_config(tmp_path, catalog_url, **more):
    return zephon.CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        catalog_url=catalog_url,
        emergency_save={"signals": ["SIGUSR1"], "grace_s": 60, "when": "now"},
        **more,
    )


def recorded_exit(manager: zephon.CheckpointManager) -> tuple[list[int], threading.Event]:
    """Replace the process's end after the emergency save by a recorder."""
    codes: list[int] = []
    done = threading.Event()

    def leave(code: int) -> None:
        codes.append(code)
        done.set()

    manager._now.exit = leave
    return codes, done


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(8, 2)).pow(2).mean().backward()
    optimizer.step()


def test_a_signal_inside_a_step_saves_the_last_boundary_at_once(tmp_path, catalog_url, caplog):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": optimizer}
    before = signal.getsignal(signal.SIGUSR1)
    config = now_config(tmp_path, catalog_url, period_steps=2)
    manager = zephon.CheckpointManager(config, run_name="r", total_steps=9)
    codes, done = recorded_exit(manager)
    with manager:
        manager.load_latest(state)
        for step in (1, 2, 3):
            train_step(model, optimizer)
            manager.maybe_save(step, state)
        boundary = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():  # step 4, half done: the live state is torn
            model.weight.add_(100.0)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert done.wait(60), "the watcher never saved"
        # the main thread never came back to a boundary: the save did not wait for one
    assert codes == [128 + signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) == before  # restored at close
    url = f"{tmp_path}/ckpt/r/save-3"
    lines = [r.getMessage() for r in caplog.records if "emergency save of" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("zephon: SIGUSR1: emergency save of step 3 ")
    assert lines[0].endswith(f" s ({url}); exiting")
    with Catalog(catalog_url) as catalog:
        row = catalog.get_checkpoint("r", 3)
        assert row.state == "committed"
        assert (row.metadata["trigger"], row.metadata["signal"]) == ("emergency", "SIGUSR1")
        events = [e for e in catalog.events(run="r") if e.action == "emergency_save"]
        assert [(e.step, e.detail["url"]) for e in events] == [(3, url)]

    fresh = nn.Linear(2, 1)
    plain = zephon.CheckpointingConfig(save_dir=str(tmp_path / "ckpt"), catalog_url=catalog_url)
    with zephon.CheckpointManager(plain, run_name="r", total_steps=9) as again:
        resume = again.load_latest(
            {"model": fresh, "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1)}
        )
    assert resume.next_step == 4
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, boundary[key]), key


def test_a_signal_after_a_periodic_save_of_the_boundary_keeps_that_save(tmp_path, catalog_url):
    model = nn.Linear(2, 1)
    state = {"model": model}
    config = now_config(tmp_path, catalog_url, period_steps=2)
    manager = zephon.CheckpointManager(config, run_name="r", total_steps=9)
    codes, done = recorded_exit(manager)
    with manager:
        manager.load_latest(state)
        manager.maybe_save(1, state)
        assert manager.maybe_save(2, state)  # the periodic save of step 2
        os.kill(os.getpid(), signal.SIGUSR1)
        assert done.wait(60)
    assert codes == [128 + signal.SIGUSR1]
    with Catalog(catalog_url) as catalog:
        assert [c.step for c in catalog.list_checkpoints("r")] == [2]
        assert (catalog.get_checkpoint("r", 2).metadata or {}).get("trigger") is None
        events = [e for e in catalog.events(run="r") if e.action == "emergency_save"]
        assert [e.step for e in events] == [2]


def test_a_signal_before_the_first_boundary_saves_nothing(tmp_path, catalog_url, caplog):
    caplog.set_level(logging.WARNING, logger="zephon")
    config = now_config(tmp_path, catalog_url)
    manager = zephon.CheckpointManager(config, run_name="r", total_steps=9)
    codes, done = recorded_exit(manager)
    with manager:
        manager.load_latest({"model": nn.Linear(2, 1)})
        os.kill(os.getpid(), signal.SIGUSR1)
        assert done.wait(60)
    assert codes == [128 + signal.SIGUSR1]
    assert any("no step boundary was reached yet" in r.getMessage() for r in caplog.records)
    with Catalog(catalog_url) as catalog:
        assert catalog.list_checkpoints("r") == []


def test_a_manager_closed_without_a_signal_stops_its_watcher(tmp_path):
    config = zephon.CheckpointingConfig(
        save_dir=str(tmp_path), emergency_save={"signals": ["SIGUSR1"], "when": "now"}
    )
    with zephon.CheckpointManager(config, run_name="r", total_steps=2) as manager:
        manager.maybe_save(1, {"value": 1})
        watcher = manager._now._thread
        assert watcher.is_alive()
    assert not watcher.is_alive()
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd was restored
