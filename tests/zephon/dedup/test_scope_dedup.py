"""``dedup_scope: save_dir`` (docs/dedup.md): chunks shared by every run under a save_dir, a
fine-tuning run's first save reusing its source checkpoint's chunks, what keeps them (another
run's markers, a save's lease) and what removes them (gc, once nothing needs them)."""

from __future__ import annotations

import datetime as dt

import pytest
import torch

from tests.conftest import make_backend
from tests.zephon.dedup.test_manager_dedup import Adapted
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager
from zephon.config import CheckpointingConfig, ModelStageConfig
from zephon.errors import ConfigError
from zephon.gc import GcPolicy, collect_garbage
from zephon.storage import CheckpointStore


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path):
    return make_backend(request.param, request, tmp_path)


def config_for(backend, catalog_url: str, **extra) -> CheckpointingConfig:
    return CheckpointingConfig(
        save_dir=backend.url,
        storage_options=backend.storage_options,
        period_steps=1,
        catalog_url=catalog_url,
        dedup=True,
        dedup_scope="save_dir",
        **extra,
    )


def shared_chunks(store: CheckpointStore) -> set[str]:
    directory = store.location.chunk_dir("save_dir", None)
    return {
        f.path.rsplit("/", 1)[-1]
        for f in store.location.backend.list_files(directory)
        if "/_leases/" not in f.path
    }


def test_a_fine_tuning_run_reuses_its_source_and_outlives_it(backend, tmp_path):
    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    model = Adapted(base_mib=2)
    with CheckpointManager(config_for(backend, catalog_url), run_name="pre", total_steps=9) as m:
        m.save(1, {"model": model})
        store = m.store
        source = store.run("pre").read_manifest(1)
    assert source.chunk_scope == "save_dir"
    assert not store.location.backend.list_files(store.run("pre").layout.chunk_dir)
    stage = ModelStageConfig(source_checkpoint=f"{backend.url}/pre/save-1")
    optimizer = torch.optim.Adam([model.adapter.weight], lr=0.1)
    with CheckpointManager(
        config_for(backend, catalog_url, num_to_keep=1),
        run_name="tune",
        total_steps=9,
        model_stage=stage,
    ) as m:
        for step in (1, 2):
            model.step(optimizer)
            m.save(step, {"model": model, "optimizer": optimizer})
        tuned = m.store.run("tune").read_manifest(2)
    first = store.run("tune").complete()[0]
    assert first.step == 2
    # the first save of "tune" already reused the source's base: only the adapter was new
    assert tuned.new_bytes < source.total_bytes / 10
    assert {c.save_id for c in tuned.chunk_refs()} >= {source.save_id}
    # the source run goes; gc keeps every chunk "tune" needs and drops the rest
    store.run("pre").delete(1)
    with Catalog(catalog_url) as catalog:
        report = collect_garbage(
            catalog,
            policy=GcPolicy(grace=dt.timedelta(0)),
            storage_options=backend.storage_options,
        )
    assert not report.problems
    assert shared_chunks(store) == {c.name for c in tuned.chunk_refs()}
    store.run("tune").verify(2, deep=True).raise_for_problems()
    fresh = Adapted(base_mib=2, seed=5)
    with CheckpointManager(config_for(backend, catalog_url), run_name="tune", total_steps=9) as m:
        assert m.load_latest({"model": fresh}).step == 2
    assert torch.equal(fresh.base.weight, model.base.weight)
    assert torch.equal(fresh.adapter.weight, model.adapter.weight)


def test_a_lease_keeps_a_base_whose_checkpoint_was_deleted_until_the_grace(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    run = store.run("r")
    fence = run.decide_resume(run.claim_attempt(after=run.lineage()), resumed_from=None)
    with run.begin(1, fence=fence) as writer:
        writer.deduplicate({}, scope="save_dir")
        with writer.open_chunked("x") as out:
            out.write(b"base" * 4096)
        base = writer.commit()
    with run.begin(2, fence=fence) as writer:
        writer.deduplicate({c.sha256: c for c in base.chunk_refs()}, scope="save_dir")
        writer.keep_base(base, scope="save_dir")
        with writer.open_chunked("x") as out:
            out.write(b"base" * 4096)
        # the base is deleted and swept while this save is in flight: its lease (out in the
        # background; a sweep that missed it is caught by the commit's check below) keeps
        # the chunk this save lists; the save itself then refuses to commit (the base is gone)
        writer._lease.result()  # noqa: SLF001 - the lease is out
        run.delete(1)
        swept = store.sweep_chunks(older_than_s=3600, finished=[base.save_id])
        assert swept.removed == 0 and swept.kept_in_flight == 1
        with pytest.raises(Exception, match="step 1"):
            writer.commit()
        writer.abort()  # what a failed save does (zephon.saving.Save.failed): the lease goes
    # with no lease left, the chunk of the deleted save goes
    assert store.sweep_chunks(older_than_s=3600, finished=[base.save_id]).removed == 1


def test_dedup_scope_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="dedup_scope"):
        CheckpointingConfig(save_dir=str(tmp_path), dedup=True, dedup_scope="bucket")
    with pytest.raises(ConfigError, match="dedup_scope"):
        CheckpointingConfig(
            save_dir=str(tmp_path),
            dedup=True,
            dedup_scope="save_dir",
            local_dir=str(tmp_path / "local"),
        )
