"""A commit marker whose reply was lost, through every way zephon saves: the checkpoint manager
(straight to S3, and through its local tier's upload) and ``zephon.dcp.Writer``. The marker PUT
reaches moto, its reply never comes back (``tests.faults.FaultProxy.drop_reply``); the save
must commit, and the next job must resume from it (issue 19: the abort used to delete the
payload under the marker, and a job with ``on_corrupt: fail`` could never start again)."""

from __future__ import annotations

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.faults import FaultProxy
from tests.storage.test_lost_replies import DROPS, MARKER, through
from zephon import CheckpointingConfig, CheckpointManager, StorageError
from zephon import dcp as zd
from zephon.storage.backends import S3Backend


@pytest.fixture
def proxy(s3, monkeypatch):
    monkeypatch.delenv("ZEPHON_CATALOG_URL", raising=False)
    with FaultProxy(s3.endpoint_url, seed=7) as opened:
        yield opened


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def config(url: str, options: dict, catalog: str | None, **extra) -> CheckpointingConfig:
    return CheckpointingConfig(
        save_dir=url,
        storage_options=options,
        period_steps=1,
        catalog_url=catalog,
        on_corrupt="fail",
        **extra,
    )


def no_client_retries(monkeypatch) -> None:
    """s3fs and botocore do not resend: the reset reaches Zephon (``through(..., False)``)."""
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)


@pytest.mark.parametrize(
    ("with_catalog", "tier", "client_retries"),
    [
        # the job: the client resent the PUT and got 412 for its own marker
        pytest.param(False, False, True, id="no catalog-client retries"),
        pytest.param(False, False, False, id="no catalog"),
        pytest.param(True, False, False, id="catalog"),
        pytest.param(False, True, False, id="local tier-no catalog"),
        pytest.param(True, True, False, id="local tier-catalog"),
    ],
)
def test_a_manager_save_whose_marker_reply_was_lost_commits_and_resumes(
    s3_backend, proxy, tmp_path, monkeypatch, with_catalog, tier, client_retries
):
    if not client_retries:
        no_client_retries(monkeypatch)
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}" if with_catalog else None
    extra = {"local_dir": str(tmp_path / "local")} if tier else {}
    options = through(s3_backend, proxy, client_retries)
    saving = config(s3_backend.url, options, catalog, **extra)
    saved = model(1)
    with CheckpointManager(saving, run_name="r", total_steps=10) as manager:
        manager.load_latest({"model": model(0)})
        proxy.drop_reply(method="PUT", path=MARKER, count=DROPS)
        manager.save(3, {"model": saved, "notes": {"at": 3}})
        manager.wait()
    assert proxy.outcomes("drop_reply") and proxy.pending_rules == 0
    resuming = config(s3_backend.url, s3_backend.storage_options, catalog)
    loaded = model(2)
    with CheckpointManager(resuming, run_name="r", total_steps=10) as manager:
        resume = manager.load_latest({"model": loaded, "notes": {}})
    assert (resume.step, resume.next_step, resume.values) == (3, 4, {"notes": {"at": 3}})
    for mine, theirs in zip(loaded.parameters(), saved.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_dcp_writer_save_whose_marker_reply_was_lost_commits_and_loads(
    s3_backend, proxy, monkeypatch
):
    no_client_retries(monkeypatch)
    url = f"{s3_backend.url}/r"
    state = {"weight": torch.arange(6.0).reshape(2, 3)}
    writer = zd.Writer(url, step=100, storage_options=through(s3_backend, proxy, False))
    proxy.drop_reply(method="PUT", path=MARKER, count=DROPS)
    dcp.save(state, storage_writer=writer)
    writer.close()
    assert proxy.outcomes("drop_reply") and proxy.pending_rules == 0
    loaded = {"weight": torch.zeros(2, 3)}
    reader = zd.Reader(url, storage_options=s3_backend.storage_options)
    dcp.load(loaded, storage_reader=reader)
    assert reader.step == 100 and torch.equal(loaded["weight"], state["weight"])
    assert reader.store.run("r").verify(100, deep=True).ok


def unreadable_once_sent(monkeypatch) -> None:
    """Once a marker was sent, reading it back fails as if the connection dropped: the proxy
    cannot tell the manager's probe before the save from the read-back after the marker."""
    sent: set[str] = set()
    create, read = S3Backend.create_exclusive, S3Backend.read_small

    def create_and_note(backend, path: str, data: bytes) -> None:
        sent.add(path)
        create(backend, path, data)

    def read_unless_sent(backend, path: str) -> bytes:
        if path in sent:  # translated as the backend translates a failure it gave up on
            with backend._doing("reading", path):
                raise ConnectionResetError(f"connection reset reading {path}")
        return read(backend, path)

    monkeypatch.setattr(S3Backend, "create_exclusive", create_and_note)
    monkeypatch.setattr(S3Backend, "read_small", read_unless_sent)


@pytest.mark.parametrize("with_catalog", [False, True], ids=["no catalog", "catalog"])
def test_a_manager_save_of_unknown_outcome_keeps_its_files_and_the_next_job_resumes_it(
    s3_backend, proxy, tmp_path, monkeypatch, with_catalog
):
    no_client_retries(monkeypatch)
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}" if with_catalog else None
    # a short policy: it gives up on the marker as the default one does, in seconds not 30
    brief = {"deadline_s": 3.0, "max_backoff_s": 0.5}
    saving = config(s3_backend.url, through(s3_backend, proxy, False), catalog, retry=brief)
    saved = model(1)
    with CheckpointManager(saving, run_name="r", total_steps=10) as manager:
        manager.load_latest({"model": model(0)})
        # the marker lands, and then nothing about it is ever answered
        proxy.drop_reply(method="PUT", path=MARKER, count=20)
        unreadable_once_sent(monkeypatch)
        with pytest.raises(StorageError, match="was created is unknown"):
            manager.save(3, {"model": saved})
        monkeypatch.undo()
    resuming = config(s3_backend.url, s3_backend.storage_options, catalog)
    loaded = model(2)
    with CheckpointManager(resuming, run_name="r", total_steps=10) as manager:
        resume = manager.load_latest({"model": loaded})
    assert (resume.step, resume.next_step) == (3, 4)
    for mine, theirs in zip(loaded.parameters(), saved.parameters(), strict=True):
        assert torch.equal(mine, theirs)
