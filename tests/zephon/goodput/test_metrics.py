"""Metrics for scrapers (``zephon.metrics``): the job's HTTP endpoint is scraped for real and
its textfile read after real saves and loads; the values move with each save. Without
``prometheus-client`` a job that asks for metrics fails at once with one line naming the
extra. The local tier's upload lag (``Destination.backlog``) is seen pending in an outage of
save_dir and back to zero once it is over."""

from __future__ import annotations

import contextlib
import re
import sys
import time
import urllib.request

import pytest
from torch import nn

from tests.faults import FaultProxy
from tests.zephon.tier.test_tier import config as tier_config
from tests.zephon.tier.test_tier import state_at, through
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig
from zephon.destinations.local.uploader import UploadsFailedError
from zephon.errors import ConfigError
from zephon.metrics import EXTRA_HINT, MetricsConfig
from zephon.storage import NO_RETRY

_SAMPLE = re.compile(r'^(\w+)\{run="(?:[^"]*)"(?:,le="[^"]*")?\} (\S+)$')


def samples(text: str) -> dict[str, float]:
    """``name -> value`` of every sample of the exposition ``text`` (histogram buckets left
    out)."""
    found = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and "_bucket" not in match.group(1):
            found[match.group(1)] = float(match.group(2))
    return found


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        return samples(reply.read().decode())


def test_saves_and_loads_move_the_scraped_metrics_and_the_textfile(tmp_path):
    textfile = tmp_path / "zephon.prom"
    config = CheckpointingConfig(
        save_dir=str(tmp_path / "ckpt"),
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        period_steps="auto",
        auto_period={"min_steps": 2, "max_steps": 5},
        metrics={"prometheus_port": 0, "textfile": str(textfile)},
    )
    model = nn.Linear(64, 64)
    with CheckpointManager(config, run_name="r") as manager:
        manager.load_latest({"model": model})
        port = manager.instruments.metrics.port
        assert port and port > 0
        before = scrape(port)
        assert before["zephon_save_seconds_count"] == 0
        assert before["zephon_load_seconds_count"] == 1  # the fresh start's lookup
        assert before["zephon_save_period_steps"] == 2
        manager.save(1, {"model": model})
        once = scrape(port)
        manager.save(2, {"model": model})
        twice = scrape(port)
        written = samples(textfile.read_text())
    assert once["zephon_save_seconds_count"] == 1 and twice["zephon_save_seconds_count"] == 2
    assert twice["zephon_save_stall_seconds_count"] == 2
    assert 0 < once["zephon_save_seconds_sum"] < twice["zephon_save_seconds_sum"]
    assert once["zephon_saved_bytes_total"] > 64 * 64 * 4
    assert twice["zephon_saved_bytes_total"] > once["zephon_saved_bytes_total"]
    assert twice["zephon_last_saved_step"] == 2
    assert twice["zephon_uploads_pending"] == 0  # no local tier
    assert 0 < twice["zephon_goodput_ratio"] <= 1
    assert written["zephon_save_seconds_count"] == 2  # the file is rewritten after each save
    with pytest.raises(OSError):  # closing the manager stops the endpoint
        scrape(port)
    with CheckpointManager(config, run_name="r") as manager:
        manager.load_latest({"model": model})
        loaded = scrape(manager.instruments.metrics.port)
    assert loaded["zephon_load_seconds_count"] == 1
    assert loaded["zephon_loaded_bytes_total"] > 64 * 64 * 4


def test_the_local_tiers_upload_lag_is_exported(s3, s3_backend, tmp_path):
    textfile = tmp_path / "zephon.prom"
    with FaultProxy(s3.endpoint_url, seed=3) as proxy:
        config = tier_config(
            through(s3_backend, proxy),
            tmp_path / "local",
            None,
            max_pending_uploads=3,
            retry=NO_RETRY,
            metrics={"textfile": str(textfile)},
        )
        with CheckpointManager(config, run_name="tiered", total_steps=10) as manager:
            manager.tier.uploader.retry_base_s = manager.tier.uploader.retry_max_s = 0.3
            manager.save(1, state_at(1))
            manager.wait()
            assert manager.destination.backlog() == (0, 0.0)
            proxy.outage(True)
            manager.save(2, state_at(2))
            time.sleep(0.2)
            pending, age = manager.destination.backlog()
            assert pending == 1 and age >= 0.2
            manager.instruments.metrics.write()
            lag = samples(textfile.read_text())
            assert lag["zephon_uploads_pending"] == 1
            assert lag["zephon_upload_oldest_age_seconds"] >= 0.2
            proxy.outage(False)
            deadline = time.monotonic() + 120
            while manager.destination.backlog()[0] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert manager.destination.backlog() == (0, 0.0)
            with contextlib.suppress(UploadsFailedError):
                manager.wait()  # reports the failures of the outage, once
            manager.wait()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prometheus_port": -1}, r"metrics\.prometheus_port = -1 is invalid: use a port"),
        ({"prometheus_port": "9400"}, r"metrics\.prometheus_port = '9400' is invalid"),
        ({"textfile": ""}, r"metrics\.textfile = '' is invalid: use a file path"),
        ({}, r"metrics names no output: set .*metrics\.prometheus_port"),
        ({"port": 1}, r"metrics\.port is not a known setting; known: prometheus_port"),
        ("9400", r"metrics = '9400' is invalid: use a mapping"),
    ],
)
def test_wrong_metrics_options_are_one_line_naming_the_key(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message) as raised:
        CheckpointingConfig(save_dir=str(tmp_path), metrics=options)
    assert "trainer.checkpointing.metrics" in str(raised.value)
    assert len(str(raised.value).splitlines()) == 1


def test_metrics_without_the_extra_name_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(ConfigError) as raised:
        CheckpointingConfig(save_dir=str(tmp_path), metrics={"textfile": "m.prom"})
    assert str(raised.value) == (
        "metrics need the prometheus-client package, which is not installed: "
        "pip install 'zephon[prometheus]'"
    )
    assert EXTRA_HINT == "pip install 'zephon[prometheus]'"
    # a job without metrics never needs it
    assert CheckpointingConfig(save_dir=str(tmp_path)).metrics is None
    assert MetricsConfig.checked(None, "metrics") is None
