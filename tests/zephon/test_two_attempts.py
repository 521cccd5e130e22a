"""Two attempts (job starts) of one run, each a real process, held at exact points of the save
path while the other goes on: a preempted job still running beside its replacement.

Each process is ``tests/zephon/attempt_child.py``, a command interpreter the test drives one
call at a time (begin, write, commit, committed, retention, find latest, register), so every
interleaving here is deterministic. Both use the same storage root and catalog; every scenario
runs on local disk and S3 (moto), with SQLite and PostgreSQL, and without a catalog where a
job can run without one. The checkpoint manager's own scenarios (corruption, a checkpoint that
vanished after it was chosen) run it in this process with a tiny torch model.

After every scenario ``assert_restart_resumes`` checks the closing invariant: a restart resumes
the newest attempt's own history, catalog and storage agree on it, it verifies deeply, and
asking again gives the same answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import select
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from tests import zygote
from tests.conftest import DISK_AND_OBJECT_STORE, Backend, database_url, make_backend
from tests.zephon.saves import largest_tensor_slice
from tests.zephon.test_composition import make_run
from zephon.attempts import register_resuming
from zephon.catalog import Catalog
from zephon.checkpointing import CheckpointManager
from zephon.checkpointing.files import decode_json, rank_file
from zephon.config import CheckpointingConfig
from zephon.dcp import writer as dcp_writer
from zephon.latest import find_latest
from zephon.locations import RunLocation
from zephon.storage import CheckpointStore
from zephon.storage.backend import list_files
from zephon.sync import sync_storage

#: two real job processes per test: the slow set (README.md, "Quick start")
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZEPHON = os.path.join(os.path.dirname(sys.executable), "zephon")
#: how long a child may take to answer one command before the test gives up on it
ANSWER_TIMEOUT_S = 60


# -- the two processes ---------------------------------------------------------------------


class Child:
    """One attempt's process. ``ok(command)`` returns the value of a command that must
    succeed, ``refused(command)`` the answer of one that must fail; either way the process
    then waits, paused, for the next command."""

    def __init__(self) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.proc = zygote.popen(  # forked from an interpreter that imported torch
            ["-m", "tests.zephon.attempt_child"],
            cwd=REPO,
            env=dict(os.environ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, command: str) -> dict:
        self.proc.stdin.write(f"{command}\n".encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            state = "exited" if self.proc.poll() is not None else "did not answer"
            pytest.fail(f"attempt process {self.pid} {state} on {command!r}:\n{self.errors()}")
        return json.loads(line)

    def ok(self, command: str):
        answer = self.send(command)
        assert answer["ok"], f"{command!r} failed: {answer}"
        return answer["value"]

    def refused(self, command: str) -> dict:
        answer = self.send(command)
        assert not answer["ok"], f"{command!r} was not refused: {answer}"
        return answer

    def errors(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(b"exit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._stderr.close()


class Children:
    """Attempt processes for the tests: started ahead of time (importing takes longer than
    most scenarios), and each handed to the next test once its test closed what it opened."""

    def __init__(self) -> None:
        self._idle: deque[Child] = deque(Child() for _ in range(2))

    def take(self) -> Child:
        return self._idle.popleft() if self._idle else Child()

    def give_back(self, child: Child) -> None:
        answer = None
        if child.proc.poll() is None:
            with contextlib.suppress(Exception):
                answer = child.send("close")
        if answer is not None and answer["ok"]:
            self._idle.append(child)
        else:
            child.close()

    def close(self) -> None:
        while self._idle:
            self._idle.popleft().close()


@pytest.fixture(scope="session")
def children() -> Iterator[Children]:
    pool = Children()
    yield pool
    pool.close()


# -- where the run lives -------------------------------------------------------------------


@dataclasses.dataclass
class World:
    """One run's storage root and catalog (None: the job runs without one), as both
    processes and this test see them."""

    backend: Backend
    catalog_url: str | None
    catalog: Catalog | None
    location: RunLocation

    @property
    def store(self) -> CheckpointStore:
        return self.location.store

    def open_command(self) -> str:
        args = {
            "catalog_url": self.catalog_url,
            "url": self.backend.url,
            "storage_options": self.backend.storage_options,
            "run": "r",
        }
        return f"open {json.dumps(args)}"

    def row(self, step: int):
        return self.catalog.get_checkpoint("r", step)

    def content(self, step: int, name: str = "w.bin") -> str:
        """A file of the checkpoint, read through the CRC-checking reader."""
        return self.store.run("r").reader(step).read_bytes(name).decode()

    def keep(self, num_to_keep: int) -> None:
        if self.catalog is not None:
            self.catalog.update_run("r", num_to_keep=num_to_keep)


@contextlib.contextmanager
def opened_world(request, tmp_path, storage: str, catalog_kind: str | None) -> Iterator[World]:
    backend = make_backend(storage, request, tmp_path)
    if catalog_kind is None:
        yield World(backend, None, None, RunLocation("r", backend.open_store(), "r"))
        return
    with database_url(catalog_kind, request, tmp_path) as url, Catalog(url) as catalog:
        yield World(backend, url, catalog, make_run(catalog, backend))


#: one local disk and one object store: the two ways the save path commits
STORAGES = DISK_AND_OBJECT_STORE
WITH_CATALOG = [(s, c) for s in STORAGES for c in ("sqlite", "postgresql")]
WITH_OR_WITHOUT = [(s, c) for s in STORAGES for c in ("sqlite", "postgresql", None)]


def _ids(params) -> list[str]:
    return [f"{storage}-{kind or 'no_catalog'}" for storage, kind in params]


@pytest.fixture(params=WITH_OR_WITHOUT, ids=_ids(WITH_OR_WITHOUT))
def world(request, tmp_path) -> Iterator[World]:
    """Every storage, with each catalog and without one."""
    with opened_world(request, tmp_path, *request.param) as opened:
        yield opened


@pytest.fixture(params=WITH_CATALOG, ids=_ids(WITH_CATALOG))
def cataloged(request, tmp_path) -> Iterator[World]:
    """Every storage with each catalog."""
    with opened_world(request, tmp_path, *request.param) as opened:
        yield opened


@contextlib.contextmanager
def attempt_pair(children: Children, world: World) -> Iterator[tuple[Child, Child]]:
    """Two processes opened on ``world``: the old attempt and the new one."""
    taken = [children.take(), children.take()]
    try:
        for child in taken:
            child.ok(world.open_command())
        yield taken[0], taken[1]
    finally:
        for child in taken:
            children.give_back(child)


@pytest.fixture
def attempts(children, world) -> Iterator[tuple[Child, Child]]:
    """The old and the new attempt's processes, on ``world``."""
    with attempt_pair(children, world) as pair:
        yield pair


@pytest.fixture
def cataloged_attempts(children, cataloged) -> Iterator[tuple[Child, Child]]:
    with attempt_pair(children, cataloged) as pair:
        yield pair


# -- helpers -------------------------------------------------------------------------------


def begun(child: Child, step: int, author: str) -> str:
    """A save through the child, begun and its file (naming its author) written, but no marker
    yet: where a stalled attempt stops. Returns the save id."""
    save_id = child.ok(f"begin {step}")
    child.ok(f"write w.bin {author}-{step}")
    return save_id


def save(child: Child, step: int, author: str) -> str:
    """A complete save through the child; the file names its author. Returns the save id."""
    save_id = begun(child, step, author)
    child.ok("commit")
    child.ok("committed")
    return save_id


def stalled(old: Child, committed: tuple[int, ...], step: int) -> str:
    """The old attempt starts afresh, commits the steps ``committed`` and stalls in its save of
    ``step`` (``begun``). Returns that save's id."""
    old.ok("start none")
    for done in committed:
        save(old, done, "old")
    return begun(old, step, "old")


def assert_names_the_new_attempt(answer: dict, started: dict) -> None:
    """A refusal that says which attempt took over: its epoch, host, pid and start time."""
    assert answer["error"] == "StaleAttemptError", answer
    message = answer["message"]
    when = dt.datetime.fromisoformat(started["started_at"])
    assert f"epoch {started['epoch']}" in message, message
    assert f"host {started['host']}" in message and f"pid {started['pid']}" in message, message
    assert started["started_at"] in message or when.isoformat() in message, message


def written_by(store: CheckpointStore, step: int) -> str:
    return store.run("r").reader(step).read_bytes("w.bin").decode()


def choose_latest(location: RunLocation, catalog: Catalog | None):
    def choose(lineage):
        latest = find_latest(location, catalog=catalog, lineage=lineage)
        return (latest.step if latest is not None else None), latest

    return choose


def assert_restart_resumes(
    world: World,
    step: int,
    author: str = "new",
    read: Callable[[CheckpointStore, int], str] = written_by,
) -> None:
    """The closing invariant: a restart (a fresh registration and ``find_latest``) resumes
    ``step`` of the newest attempt's history, written by ``author``; the catalog's latest is
    storage's own answer and verifies deeply; asking again changes nothing."""
    location, catalog, store = world.location, world.catalog, world.store
    attempt, latest = register_resuming(location, catalog, choose_latest(location, catalog))
    assert latest is not None and latest.step == step, latest
    assert attempt.resumed_from == step
    assert read(store, step).startswith(f"{author}-"), read(store, step)
    assert store.run("r").lineage().admits(latest.manifest.epoch, step)
    on_storage = store.run("r").latest()
    assert (on_storage.step, on_storage.save_id) == (step, latest.manifest.save_id)
    if catalog is not None:
        row = catalog.latest_committed("r")
        assert (row.step, row.save_id, row.epoch) == (step, on_storage.save_id, on_storage.epoch)
    report = store.run("r").verify(step, deep=True)
    assert report.ok, report.problems
    again = find_latest(location, catalog=catalog)
    assert (again.step, again.manifest.save_id, again.source) == (
        latest.step,
        latest.manifest.save_id,
        latest.source,
    )
    assert (again.promoted, again.missing, again.set_aside) == ((), (), ())


def payload_files(store: CheckpointStore, step: int, save_id: str) -> dict[str, int]:
    path = f"{store.run('r').checkpoint_path(step)}/{save_id}"
    return {f.path[len(path) + 1 :]: f.size for f in list_files(store.location, path)}


def zephon_gc(world: World, *extra: str) -> dict:
    """The real ``zephon gc`` command on the world's catalog; its JSON report."""
    done = subprocess.run(
        [
            ZEPHON,
            "gc",
            "--catalog",
            world.catalog_url,
            "--storage-options",
            json.dumps(world.backend.storage_options),
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert not report["problems"], report
    return report


# -- 1. a stalled save wakes up after the new attempt saved its step -----------------------


def test_an_old_attempt_waking_after_the_new_one_committed_its_step_is_refused(world, attempts):
    old, new = attempts
    old.ok("start none")
    save(old, 30, "old")
    save(old, 40, "old")
    old.ok("begin 50")  # ... and the old attempt stalls here

    started = new.ok("start latest")
    assert (started["latest"]["step"], started["resumed_from"]) == (40, 40)
    assert started["pid"] == new.pid
    new_save = save(new, 50, "new")

    old.ok("write w.bin old-50")  # a late write lands in the old save's own directory
    assert_names_the_new_attempt(old.refused("commit"), started)
    old.ok("fail")

    assert world.content(50) == "new-50"
    manifest = world.store.run("r").read_manifest(50)
    assert (manifest.save_id, manifest.epoch) == (new_save, started["epoch"])
    assert world.store.run("r").verify(50, deep=True).ok
    if world.catalog is not None:
        assert (world.row(50).state, world.row(50).save_id) == ("committed", new_save)
    assert_restart_resumes(world, 50)


@pytest.mark.parametrize(
    ("storage", "kind"), [("local", "sqlite"), ("local", None)], ids=["sqlite", "no_catalog"]
)
def test_every_refusal_of_a_stale_attempt_is_zephons_stale_attempt_error(
    children, request, tmp_path, storage, kind
):
    # zephon.StaleAttemptError is "raised by every fenced step of the save path (catalog
    # transitions, storage begin and the re-check before the marker, retention)": a job that
    # catches it must not miss the one its commit raises.
    with (
        opened_world(request, tmp_path, storage, kind) as world,
        attempt_pair(children, world) as (old, new),
    ):
        world.keep(1)
        stalled(old, (10, 20), 30)
        new.ok("start latest")
        refusals = {"commit": old.refused("commit")}
        old.ok("fail")
        refusals["begin"] = old.refused("begin 40")
        refusals["retain"] = old.refused("retain 1")
    where = {call: f"{a['module']}.{a['error']}" for call, a in refusals.items()}
    assert where == dict.fromkeys(refusals, "zephon.errors.StaleAttemptError")


# -- 2. a stale marker slips in between the old attempt's check and its marker -------------


def assert_nobody_takes_the_stale_marker(world: World, row: tuple[str, str]) -> None:
    """Readers skip the marker the old attempt slipped in; sync does not promote it and
    leaves the row of its step as it is, ``row`` (state, save id)."""
    assert world.store.run("r").latest().step == 40
    assert find_latest(world.location, catalog=world.catalog).step == 40
    if world.catalog is not None:
        report = sync_storage(world.catalog, world.backend.url, world.backend.storage_options)
        assert report.outcomes.get("stale") == 1, report.outcomes
        assert (world.row(50).state, world.row(50).save_id) == row


@pytest.mark.parametrize("slipped_in", ["while_the_new_save_is_written", "before_it_begins"])
def test_a_marker_the_old_attempt_slips_in_after_its_check_is_superseded_by_the_new_save(
    world, attempts, slipped_in
):
    old, new = attempts
    old_save = stalled(old, (30, 40), 50)  # its payload check passes: held before the marker

    started = new.ok("start latest")
    assert started["resumed_from"] == 40
    if slipped_in == "before_it_begins":
        forged = old.ok("forge_marker 50")
        assert_nobody_takes_the_stale_marker(world, ("stale", old_save))
    new_save = new.ok("begin 50")  # supersedes a stale marker already there
    new.ok("write w.bin new-50")
    if slipped_in == "while_the_new_save_is_written":
        forged = old.ok("forge_marker 50")  # the window the re-check narrows, cannot close
        assert_nobody_takes_the_stale_marker(world, ("pending", new_save))
    assert (forged["save_id"], forged["epoch"]) == (old_save, started["epoch"] - 1)

    committed = new.ok("commit")  # supersedes a stale marker that appeared meanwhile
    assert (committed["save_id"], committed["epoch"]) == (new_save, started["epoch"])
    new.ok("committed")
    if world.catalog is not None:  # the catalog refuses to record the stale marker
        assert_names_the_new_attempt(old.refused("committed"), started)

    manifest = world.store.run("r").read_manifest(50)
    assert (manifest.save_id, manifest.epoch) == (new_save, started["epoch"])
    assert world.content(50) == "new-50"
    assert payload_files(world.store, 50, old_save) == {}  # the stale save went with its marker
    if world.catalog is not None:
        report = sync_storage(world.catalog, world.backend.url, world.backend.storage_options)
        assert set(report.outcomes) == {"unchanged"}, report.outcomes
        row = world.row(50)
        assert (row.state, row.save_id, row.epoch) == ("committed", new_save, started["epoch"])
    assert_restart_resumes(world, 50)


# -- 3. the old attempt keeps saving as if nothing happened --------------------------------


def test_an_old_attempt_that_keeps_saving_is_refused_everywhere_and_deletes_nothing(
    world, attempts
):
    old, new = attempts
    world.keep(1)
    stalled(old, (10, 20, 30, 40), 50)

    started = new.ok("start latest")
    assert started["resumed_from"] == 40
    save(new, 45, "new")

    refusals = [old.refused("commit")]
    old.ok("fail")
    for step in (50, 60, 70):
        refusals.append(old.refused(f"begin {step}"))
        refusals.append(old.refused("retain 1"))
    for refusal in refusals:
        assert_names_the_new_attempt(refusal, started)

    assert world.store.run("r").committed_steps() == [10, 20, 30, 40, 45]
    if world.catalog is not None:
        committed = [r.step for r in world.catalog.list_checkpoints("r", states="committed")]
        assert committed == [10, 20, 30, 40, 45]
        assert world.row(50).state == "stale"
        assert {r.step for r in world.catalog.list_checkpoints("r")} == {10, 20, 30, 40, 45, 50}
    assert world.content(45) == "new-45" and world.store.run("r").verify(45, deep=True).ok

    # the new attempt's own retention runs (its resume point is kept only until it has a
    # checkpoint of its own)
    assert new.ok("retain 1") == [10, 20, 30, 40]
    assert world.store.run("r").committed_steps() == [45]
    assert_restart_resumes(world, 45)


# -- 4. retention of the old attempt once the new one chose its resume point ---------------


def test_the_old_attempts_commit_and_retention_are_refused_once_the_new_one_claimed(
    world, attempts
):
    # The new attempt claims its epoch before it chooses where to resume: from then on the
    # old one, paused in a save of 40, can neither commit it nor apply retention (keep 1)
    # that would delete the 30 the new one is about to choose.
    old, new = attempts
    world.keep(1)
    stalled(old, (10, 20, 30), 40)

    new.ok("claim")
    old.refused("commit")
    old.refused("retain 1")
    assert new.ok("choose")["step"] == 30
    started = new.ok("decide")
    assert started["resumed_from"] == 30
    assert_names_the_new_attempt(old.refused("retain 1"), started)
    assert world.store.run("r").committed_steps() == [10, 20, 30]
    assert world.content(30) == "old-30"
    assert world.store.run("r").verify(30, deep=True).ok
    if world.catalog is not None:
        assert world.row(30).state == "committed" and world.row(40).state == "stale"

    save(new, 40, "new")
    assert_restart_resumes(world, 40)


def test_a_marker_the_old_attempt_slips_in_before_the_new_one_chooses_is_resumed_from(
    world, attempts
):
    # The remaining window: the old attempt passed its last fence check before the claim and
    # creates its marker of 50 after it. The new attempt has not chosen yet, so 50 is still
    # part of the history it continues, and it resumes from it instead of abandoning it.
    old, new = attempts
    world.keep(1)
    stalled(old, (10, 20, 30, 40), 50)

    new.ok("claim")
    old.ok("forge_marker 50")
    old.refused("retain 1")
    chosen = new.ok("choose")
    assert chosen["step"] == 50, chosen
    new.ok("decide")
    latest = new.ok("latest")
    assert latest is not None and latest["step"] == 50
    assert world.content(50) == "old-50"
    save(new, 60, "new")
    assert_restart_resumes(world, 60)


# -- 5. a marker whose row says failed or deleted -----------------------------------------


def _complete_then_failed(world: World, old: Child, new: Child) -> None:
    """The old attempt's save of 50 created its marker, then failed before the catalog
    heard of its commit: the row says failed."""
    begun(old, 50, "old")
    old.ok("commit")
    old.ok("fail")
    assert world.row(50).state == "failed"


def _complete_then_deleted(world: World, old: Child, new: Child) -> None:
    """The old attempt committed 50; a sync that missed its marker marked the row deleted."""
    save(old, 50, "old")
    assert world.catalog.mark_missing("r", 50)
    assert world.row(50).state == "deleted"


def _stale_marker_on_failed(world: World, old: Child, new: Child) -> None:
    """The new attempt re-armed 50 and failed; the old one slipped its marker in meanwhile."""
    begun(old, 50, "old")
    assert new.ok("start latest")["resumed_from"] == 40
    new_save = new.ok("begin 50")
    old.ok("forge_marker 50")
    new.ok("write w.bin new-50")
    new.ok("fail")
    assert (world.row(50).state, world.row(50).save_id) == ("failed", new_save)
    assert world.store.run("r").read_manifest(50).epoch == 1


def _stale_marker_on_deleted(world: World, old: Child, new: Child) -> None:
    """A committed, then deleted, row of the old attempt's 50, abandoned by the new attempt."""
    save(old, 50, "old")
    assert world.catalog.mark_missing("r", 50)
    assert new.ok("start 40")["resumed_from"] == 40
    assert world.row(50).state == "deleted"


def _flip_a_byte(store: CheckpointStore, step: int, name: str) -> None:
    path = f"{store.run('r').reader(step).path}/{name}"
    data = bytearray(store.location.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.location.fs.pipe_file(path, bytes(data))


def _complete_then_failed_and_damaged(world: World, old: Child, new: Child) -> None:
    """Like ``_complete_then_failed``, and a byte of its file flipped since."""
    _complete_then_failed(world, old, new)
    _flip_a_byte(world.store, 50, "w.bin")


# (how the run got there, whether the restart resumes 50, the state the row of 50 ends in)
MARKER_WITH_ROW = {
    "failed": (_complete_then_failed, True, "committed"),
    "deleted": (_complete_then_deleted, True, "committed"),
    "failed_with_a_stale_marker": (_stale_marker_on_failed, False, "stale"),
    "deleted_with_a_stale_marker": (_stale_marker_on_deleted, False, "deleted"),
    "failed_and_damaged": (_complete_then_failed_and_damaged, False, "corrupt"),
}


@pytest.mark.parametrize("situation", list(MARKER_WITH_ROW))
def test_a_restart_repairs_a_complete_marker_the_row_disowns_and_never_a_stale_one(
    cataloged, cataloged_attempts, situation
):
    world, (old, new) = cataloged, cataloged_attempts
    arrange, resumes_50, row_state = MARKER_WITH_ROW[situation]
    old.ok("start none")
    save(old, 30, "old")
    save(old, 40, "old")
    arrange(world, old, new)

    started = new.ok("start latest")  # find_latest, register: a restart
    latest = started["latest"]
    if resumes_50:
        assert (latest["step"], latest["promoted"]) == (50, [50])
        assert world.content(50) == "old-50"
    else:
        assert (latest["step"], latest["promoted"]) == (40, [])
        assert world.store.run("r").latest().step == 40
    assert started["resumed_from"] == latest["step"]
    assert world.row(50).state == row_state
    if situation == "failed_and_damaged":
        assert [step for step, _ in world.store.run("r").condemned()] == [50]

    again = new.ok("latest")  # nothing keeps changing
    assert (again["step"], again["promoted"], again["set_aside"]) == (latest["step"], [], [])

    step = latest["step"] + 10
    save(new, step, "new")  # no CommitConflictError: a stale marker there is superseded
    assert_restart_resumes(world, step)


# -- 6. gc with no grace beside a live save ------------------------------------------------


@pytest.mark.parametrize("paused", ["after_writing", "after_begin"])
def test_gc_without_grace_beside_a_live_save_leaves_it_whole(cataloged, cataloged_attempts, paused):
    world, (old, new) = cataloged, cataloged_attempts
    old_save = stalled(old, (30, 40), 50)  # the old attempt's save: stalled, then abandoned

    assert new.ok("start latest")["resumed_from"] == 40
    new_save = new.ok("begin 50")
    if paused == "after_writing":
        new.ok("write w.bin new-50")
    before = payload_files(world.store, 50, new_save)

    report = zephon_gc(world, "--grace", "0")
    assert [o["url"].rsplit("/", 1)[-1] for o in report["orphans"]] == [old_save]
    assert (report["deleted"], report["settled"]) == ([], [])
    assert payload_files(world.store, 50, new_save) == before
    assert payload_files(world.store, 50, old_save) == {}
    assert (world.row(50).state, world.row(50).save_id) == ("pending", new_save)

    if paused == "after_begin":
        new.ok("write w.bin new-50")
    new.ok("commit")
    new.ok("committed")
    assert world.store.run("r").verify(50, deep=True).ok
    assert world.content(50) == "new-50"
    old.refused("commit")  # its files are gone and it is stale: refused either way
    old.ok("fail")
    assert_restart_resumes(world, 50)


# -- the checkpoint manager, in this process -----------------------------------------------


def tiny_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two equal tensors: DCP writes them into two shard files of the same size."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def run_job(world: World, job: str, steps: list[int]):
    """One start of a training job through ``CheckpointManager``: load the latest
    checkpoint, then save ``steps`` with notes naming ``job``. Returns the ``Resume``."""
    config = CheckpointingConfig(
        save_dir=world.backend.url,
        storage_options=world.backend.storage_options,
        period_steps=1,
        catalog_url=world.catalog_url,
    )
    model, optimizer = tiny_model()
    with CheckpointManager(config, run_name="r", total_steps=100) as manager:
        resume = manager.load_latest({"model": model, "optimizer": optimizer, "notes": None})
        for step in steps:
            with torch.no_grad():
                model[0].weight.add_(1.0)
            notes = {"by": f"{job}-{step}"}
            manager.save(step, {"model": model, "optimizer": optimizer, "notes": notes})
    return resume


def notes_by(store: CheckpointStore, step: int) -> str:
    reader = store.run("r").reader(step)
    return decode_json(reader.read_bytes(rank_file(0)), reader.url)["state"]["notes"]["by"]


def shards(store: CheckpointStore, step: int) -> list[str]:
    return sorted(n for n in store.run("r").reader(step).names if n.endswith(".distcp"))


def _tensor_file(store: CheckpointStore, step: int) -> tuple[str, int]:
    """The shard file holding the save's largest tensor, and the offset of the middle of that
    tensor's elements in it (where a load meets damage: tests/zephon/saves.py)."""
    reader = store.run("r").reader(step)
    where = largest_tensor_slice(reader.read_bytes("dcp/dcp_metadata.json"), reader.url)
    return f"{reader.path}/{where.file}", where.offset + where.length // 2


def flip_a_byte(store: CheckpointStore, step: int) -> None:
    path, middle = _tensor_file(store, step)
    data = bytearray(store.location.fs.cat_file(path))
    data[middle] ^= 0xFF
    store.location.fs.pipe_file(path, bytes(data))


def truncate_a_file(store: CheckpointStore, step: int) -> None:
    """An interrupted copy: the file ends inside a tensor's elements."""
    path, middle = _tensor_file(store, step)
    store.location.fs.pipe_file(path, store.location.fs.cat_file(path)[:middle])


def swap_two_shards(store: CheckpointStore, step: int) -> None:
    fs, base = store.location.fs, store.run("r").reader(step).path
    first, second = (f"{base}/{name}" for name in shards(store, step))
    one, two = fs.cat_file(first), fs.cat_file(second)
    assert len(one) == len(two) and one != two  # only the checksums tell them apart
    fs.pipe_file(first, two)
    fs.pipe_file(second, one)


def delete_the_payload(store: CheckpointStore, step: int) -> None:
    """Everything but the marker: the checkpoint is still chosen, then cannot be read."""
    reader = store.run("r").reader(step)
    store.location.fs.rm([f"{reader.path}/{name}" for name in reader.names])


def delete_the_shards(store: CheckpointStore, step: int) -> None:
    """The tensors only: its JSON reads, the load that follows fails."""
    reader = store.run("r").reader(step)
    store.location.fs.rm([f"{reader.path}/{name}" for name in shards(store, step)])


@pytest.mark.parametrize(
    "damage",
    [flip_a_byte, truncate_a_file, swap_two_shards],
    ids=["flipped_byte", "truncated_file", "swapped_shards"],
)
def test_a_damaged_newest_checkpoint_is_quarantined_resumed_past_and_collected(
    cataloged, damage, monkeypatch
):
    world, store = cataloged, cataloged.store
    if damage is swap_two_shards:  # shards to swap: as a state above the small-save bound
        monkeypatch.setattr(dcp_writer, "SMALL_PLAN_BYTES", 0)
    run_job(world, "job1", [1, 2])
    bad = store.run("r").read_manifest(2).save_id
    damage(store, 2)

    resume = run_job(world, "job2", [])
    assert resume.step == 1 and resume.values["notes"] == {"by": "job1-1"}
    assert (world.row(2).state, world.row(2).save_id) == ("corrupt", bad)
    assert store.run("r").condemned() == [(2, bad)]

    report = zephon_gc(world, "--corrupt")
    assert [d["step"] for d in report["deleted"]] == [2]
    assert store.run("r").condemned() == [] and store.run("r").committed_steps() == [1]
    assert payload_files(store, 2, bad) == {}
    assert world.row(2).state == "deleted"

    run_job(world, "job3", [2])
    assert_restart_resumes(world, 2, author="job3", read=notes_by)


@pytest.mark.parametrize(
    "vanish", [delete_the_payload, delete_the_shards], ids=["payload_gone", "shards_gone"]
)
def test_a_checkpoint_deleted_after_it_was_chosen_makes_the_load_take_the_next_one(
    cataloged, vanish
):
    world, store = cataloged, cataloged.store
    run_job(world, "job1", [1, 2, 3])
    vanish(store, 3)

    resume = run_job(world, "job2", [4])
    assert resume.step == 2 and resume.values["notes"] == {"by": "job1-2"}
    assert world.row(3).state == "corrupt"
    assert store.run("r").verify(2, deep=True).ok
    assert_restart_resumes(world, 4, author="job2", read=notes_by)
