"""The local tier's resume and its stale copies, in one process against moto's S3 (through
the counting proxy) and a SQLite or PostgreSQL catalog: a resume from the local tier sends only
the attempt's claim and decision and one listing of the run's steps to save_dir (no marker, no
payload), one from save_dir still
confirms the catalog's row there, and a stale attempt's committed local copy is marked failed
with the reason."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.latency_proxy import LatencyProxy
from tests.zephon.tier.test_tier import RUN, config, loads, state_at, superseded
from zephon import StaleAttemptError
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager


def endpoint(backend) -> str:
    return backend.storage_options["client_kwargs"]["endpoint_url"]


def through(backend, proxy: LatencyProxy):
    options = {**backend.storage_options, "client_kwargs": {"endpoint_url": proxy.url}}
    return replace(backend, storage_options=options)


def save_dir_requests(proxy: LatencyProxy) -> list[str]:
    """The request lines that touched a checkpoint (not the run's ``_attempts/``)."""
    return [line for line in proxy.request_lines if "_attempts" not in line]


def test_a_local_resume_sends_only_the_claim_and_the_decision(s3_backend, tmp_path, catalog_url):
    with LatencyProxy(endpoint(s3_backend), 0) as proxy:
        cfg = config(through(s3_backend, proxy), tmp_path / "local", catalog_url)
        with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
            manager.save(1, state_at(1))
            manager.save(2, state_at(2))
            manager.wait()
        proxy.reset()
        with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
            resume, equal = loads(manager, 2)
            assert (resume.step, equal) == (2, True)
            assert resume.url.startswith(str(tmp_path / "local"))
            # the run's steps listed twice (with the lineage: what a job that ended during a
            # catalog outage committed without rows, docs/catalog.md; after the claim: the
            # choice made ahead still stands, docs/fencing.md), and no checkpoint's marker or
            # payload
            listings = save_dir_requests(proxy)
            assert len(listings) == 2, listings
            for listing in listings:
                assert listing.startswith("GET ") and "list-type=2" in listing, listing
            methods = [line.split()[0] for line in proxy.request_lines]
            # claim: the lineage (listing, the last decision) with the steps' listing, the
            # create-only record; the steps again; decision: the fence re-check (listing), the
            # create-only decision
            assert methods == ["GET", "GET", "GET", "PUT", "GET", "GET", "PUT"], proxy.request_lines
        # Without the local copy the same resume reads save_dir's marker (confirmed) and state.
        proxy.reset()
        nolocal = replace(cfg, local_dir=None)
        with CheckpointManager(nolocal, run_name=RUN, total_steps=10) as manager:
            resume, equal = loads(manager, 2)
            assert (resume.step, equal) == (2, True)
        touched = save_dir_requests(proxy)
        assert any(line.split()[1].endswith("save-2/_COMMIT") for line in touched), touched


def test_a_newer_save_dir_checkpoint_is_confirmed_and_loaded(s3_backend, tmp_path, catalog_url):
    """R > L (another node uploaded a newer step): R is confirmed on storage and loaded."""
    with LatencyProxy(endpoint(s3_backend), 0) as proxy:
        cfg = config(through(s3_backend, proxy), tmp_path / "local", catalog_url)
        with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
            manager.save(1, state_at(1))
            manager.wait()
        other = replace(cfg, local_dir=str(tmp_path / "elsewhere"))
        with CheckpointManager(other, run_name=RUN, total_steps=10) as manager:
            loads(manager, 1)
            manager.save(2, state_at(2))
            manager.wait()
        proxy.reset()
        with CheckpointManager(cfg, run_name=RUN, total_steps=10) as manager:
            resume, equal = loads(manager, 2)
            assert (resume.step, equal) == (2, True)
            assert not resume.url.startswith(str(tmp_path))
        assert any("save-2/_COMMIT" in line for line in proxy.request_lines)


def test_a_stale_attempts_committed_local_copy_is_marked_failed(s3_backend, tmp_path, catalog_url):
    cfg = config(s3_backend, tmp_path / "local", catalog_url)
    old, _ = superseded(cfg, s3_backend, catalog_url)
    old.save(2, state_at(2))  # commits locally; its upload is refused for good
    try:
        old.wait()
    except StaleAttemptError:
        pass
    else:
        raise AssertionError("the stale attempt's upload was not refused")
    old.close()
    with Catalog(catalog_url) as catalog:
        [local] = catalog.replicas(RUN, step=2, tier="local")
        assert local.state == "failed"
        assert "StaleAttemptError" in (local.failure_reason or "")
        assert local.committed_at is not None  # it was committed locally first
        [uploaded] = catalog.replicas(RUN, step=1, tier="save_dir")
        assert uploaded.state == "committed"  # the step uploaded before the takeover stands
