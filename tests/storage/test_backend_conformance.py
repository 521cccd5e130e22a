"""Every storage backend class against one suite: its primitives, its marker race, and its
capability flags checked against what it really does.

Runs once per registered class (``storage.backends.registry``) on its test root from
tests/conftest.py (local disk, memory, moto S3, the GCS emulator), plus the generic
``Backend`` on fsspec's memory filesystem (what an unregistered protocol gets). A new backend
is one class, one ``register`` call, one ``TEST_PROTOCOLS`` entry and a ``make_backend``
branch in tests/conftest.py, and a run of this file.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass

import pytest

from tests.conftest import (
    BACKENDS,
    PRECONDITIONS_IGNORED,
    PRECONDITIONS_RACY,
    TEST_PROTOCOLS,
    backend_class,
    make_backend,
    random_payload,
)
from tests.conftest import Backend as StorageRoot
from zephon.storage import Location, open_location
from zephon.storage.backends import BACKEND_CLASSES, Backend, backend_for

GENERIC = "generic"
PART = 5 << 20


@dataclass
class Case:
    """One backend under test: its location (root made), and its test server's traits."""

    name: str
    location: Location
    test_backend: StorageRoot | None

    @property
    def backend(self) -> Backend:
        return self.location.backend

    @property
    def one_winner(self) -> bool:
        """Whether a create race must have exactly one winner on this test server."""
        return self.backend.exclusive_create and self.name not in PRECONDITIONS_IGNORED

    def path(self, *parts: str) -> str:
        return self.location.join(*parts)


@pytest.fixture(params=[*BACKENDS, GENERIC])
def case(request: pytest.FixtureRequest, tmp_path) -> Case:
    if request.param == GENERIC:
        location = open_location(f"memory://zephon-generic-{uuid.uuid4().hex[:12]}")
        location = dataclasses.replace(location, backend=Backend(location.fs, "memory"))
        return Case(GENERIC, location, None)
    test_backend = make_backend(request.param, request, tmp_path)
    location = open_location(test_backend.url, test_backend.storage_options)
    location.backend.make_dirs(location.root, durable=True)
    return Case(request.param, location, test_backend)


def write(case: Case, name: str, data: bytes) -> str:
    path = case.path(name)
    case.backend.make_dirs(path.rsplit("/", 1)[0])
    case.backend.put_bytes(path, data, PART)
    return path


# -- the registry ------------------------------------------------------------------------------


def test_every_registered_backend_class_has_a_test_root():
    assert {backend_class(name) for name in BACKENDS} == set(BACKEND_CLASSES)
    for cls in BACKEND_CLASSES:
        assert cls.protocols, cls
        assert all(backend_for(protocol) is cls for protocol in cls.protocols), cls


def test_a_location_holds_its_protocols_backend(case: Case):
    if case.name == GENERIC:
        assert backend_for("no-such-protocol") is Backend
        return
    assert type(case.backend) is backend_for(TEST_PROTOCOLS[case.name])
    assert type(case.backend).__name__ in repr(case.backend)


# -- listing, existence, reading ---------------------------------------------------------------


def test_listing_finds_every_file_below_a_path_with_its_size(case: Case):
    assert case.backend.list_files(case.path("absent")) == []
    files = {"d/a.bin": b"a", "d/sub/b.bin": b"bb", "d/sub/deeper/c.bin": b"ccc", "e/x": b"x"}
    for name, data in files.items():
        write(case, name, data)
    listed = {f.path: f.size for f in case.backend.list_files(case.path("d"))}
    assert listed == {case.path(n): len(d) for n, d in files.items() if n.startswith("d/")}
    only = case.backend.list_files(case.path(), prefix="d")
    assert {f.path for f in only} == set(listed)
    assert all(f.mtime is None or f.mtime > 0 for f in only)


def test_file_exists_answers_for_files_only(case: Case):
    path = write(case, "dir/file.bin", b"1")
    assert case.backend.file_exists(path)
    assert not case.backend.file_exists(case.path("dir/missing.bin"))
    assert not case.backend.file_exists(case.path("dir/file"))  # a prefix of a name
    assert not case.backend.file_exists(case.path("dir"))


def test_small_and_ranged_reads_return_the_bytes_asked_for(case: Case):
    data = random_payload(100_003)
    path = write(case, "r/data.bin", data)
    assert case.backend.read_small(path) == data
    assert case.backend.read_range(path, 10, 1000) == data[10:1000]
    assert case.backend.read_range(path, 100_000, 200_000) == data[100_000:]
    for chunk in (33_334, 100_003, 1 << 20):
        pieces = list(case.backend.read_ranges(path, len(data), chunk))
        assert b"".join(pieces) == data
        assert all(len(p) <= chunk for p in pieces)
    empty = write(case, "r/empty.bin", b"")
    assert b"".join(case.backend.read_ranges(empty, 0, 4096)) == b""
    with pytest.raises(FileNotFoundError):
        case.backend.read_small(case.path("r/missing.bin"))


# -- writing -----------------------------------------------------------------------------------


def test_put_bytes_writes_whole_files_in_parts_where_the_backend_uploads_in_parts(case: Case):
    assert bool(case.backend.multipart_options(PART)) == case.backend.multipart_uploads
    big = random_payload(2 * PART + 123)  # three parts where uploads go in parts
    path = write(case, "w/big.bin", big)
    assert case.backend.read_small(path) == big
    case.backend.put_small(case.path("w/ack"), b"")
    assert case.backend.file_exists(case.path("w/ack"))


def test_a_finished_write_is_visible_and_a_discarded_one_leaves_nothing(case: Case):
    case.backend.make_dirs(case.path("s"))
    done, dropped = case.path("s/done.bin"), case.path("s/dropped.bin")
    handle = case.backend.open_write(done, PART)
    handle.write(b"complete")
    case.backend.finish_write(handle)
    assert case.backend.read_small(done) == b"complete"
    handle = case.backend.open_write(dropped, PART)
    handle.write(b"partial" * 1000)
    case.backend.discard_write(handle)
    assert not case.backend.file_exists(dropped)
    assert [f.path for f in case.backend.list_files(case.path("s"))] == [done]


# -- the marker --------------------------------------------------------------------------------


def test_server_side_copy_copies_within_the_store_where_the_backend_has_it(case: Case):
    data = random_payload(PART + 17)
    source = write(case, "c/source.bin", data)
    target = case.path("c/sub/target.bin")
    case.backend.make_dirs(case.path("c/sub"))
    if not case.backend.server_side_copy:
        with pytest.raises(NotImplementedError, match="has no server-side copy"):
            case.backend.copy_file(source, target)
        return
    case.backend.copy_file(source, target)
    assert case.backend.read_file(target) == data
    with pytest.raises(FileNotFoundError):
        case.backend.copy_file(case.path("c/missing.bin"), case.path("c/other.bin"))


def test_create_exclusive_creates_once_and_refuses_the_second(case: Case):
    path = case.path("m/_COMMITTED")
    case.backend.make_dirs(case.path("m"))
    case.backend.create_exclusive(path, b"first")
    assert case.backend.read_small(path) == b"first"
    if case.name in PRECONDITIONS_IGNORED:
        # The emulator ignores ifGenerationMatch: check the request carried it instead.
        assert case.test_backend is not None
        assert len(case.test_backend.create_only_requests()) == 1
        return
    with pytest.raises(FileExistsError):
        case.backend.create_exclusive(path, b"second")
    assert case.backend.read_small(path) == b"first"


def race(backend: Backend, path: str, creators: int) -> tuple[list[int], list[int]]:
    """``creators`` threads create ``path`` at once; returns the winners and the losers."""
    start = threading.Barrier(creators)
    won: list[int] = []
    lost: list[int] = []

    def create(i: int) -> None:
        start.wait()
        try:
            backend.create_exclusive(path, f"writer {i}".encode())
            won.append(i)
        except FileExistsError:
            lost.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(creators)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won, lost


def test_a_race_of_creators_has_exactly_one_winner_on_exclusive_backends(case: Case):
    """Where the backend (and its test server) refuses a second create, exactly one of eight
    racing creators wins and the marker holds its bytes. Elsewhere (check-then-put, or the GCS
    emulator, which ignores create-only preconditions) a race may have several winners, but
    never none, and the marker is still one writer's bytes whole, listed once."""
    case.backend.make_dirs(case.path("race"))
    for round_ in range(3):
        path = case.path(f"race/marker-{round_}")
        won, lost = race(case.backend, path, 8)
        assert len(won) + len(lost) == 8
        if case.one_winner and case.name in PRECONDITIONS_RACY:
            # a loaded machine can stretch moto's lookup-then-put window over two creators,
            # but a create without the precondition would let all eight win
            assert 1 <= len(won) < 8, (won, lost)
        elif case.one_winner:
            assert len(won) == 1, (won, lost)
        else:
            assert len(won) >= 1, (won, lost)
        assert case.backend.read_small(path) in {f"writer {i}".encode() for i in won}
        assert [f.path for f in case.backend.list_files(case.path("race"))].count(path) == 1


# -- deleting and directories ------------------------------------------------------------------


def test_remove_files_deletes_in_batches_and_ignores_missing_ones(case: Case):
    paths = [write(case, f"del/f{i:04d}.bin", b"x") for i in range(30)]
    keep = write(case, "del/keep.bin", b"k")
    assert case.backend.remove_files([*paths, case.path("del/never-there")]) == 31
    assert [f.path for f in case.backend.list_files(case.path("del"))] == [keep]
    assert case.backend.remove_files([]) == 0


def test_directories_are_left_behind_only_where_the_backend_has_directories(case: Case):
    fs = case.location.fs
    path = write(case, "tree/a/b/file.bin", b"1")
    case.backend.sync_dirs([case.path("tree/a/b"), case.path("tree/a")])
    case.backend.remove_files([path])
    assert fs.exists(case.path("tree/a/b")) == case.backend.has_directories
    other = write(case, "tree/other.bin", b"2")
    case.backend.remove_dir(case.path("tree"))  # not empty: kept
    assert case.backend.file_exists(other)
    case.backend.remove_empty_dirs(case.path("tree/a"))
    assert not fs.exists(case.path("tree/a"))
    case.backend.remove_files([other])
    case.backend.remove_dir(case.path("tree"))
    assert not fs.exists(case.path("tree"))


# -- the other flags ---------------------------------------------------------------------------


def test_posix_paths_means_plain_os_paths(case: Case):
    import os

    path = write(case, "p/file.bin", b"os")
    assert os.path.isfile(path) == case.backend.posix_paths
    assert (case.backend.display(path) == path) == case.backend.posix_paths
    assert "://" in case.backend.display(path) or case.backend.posix_paths
    assert case.backend.default_workers >= 1
    if case.backend.posix_paths:
        assert case.backend.has_directories  # os paths live in real directories


# the generic backend's test root is fsspec's in-process memory filesystem: no other process
# can open it, whatever the class says, so this runs on the registered classes' roots only
@pytest.mark.parametrize("case", BACKENDS, indirect=True)
def test_cross_process_means_another_process_reads_what_was_written(case: Case):
    path = write(case, "x/shared.bin", b"seen elsewhere")
    assert case.test_backend is not None
    script = (
        "import json, sys\n"
        "from storage import open_location\n"
        "args = json.loads(sys.argv[1])\n"
        "loc = open_location(args['url'], args['options'])\n"
        "try:\n"
        "    print(loc.backend.read_small(args['path']).decode())\n"
        "except FileNotFoundError:\n"
        "    print('missing')\n"
    )
    args = {"url": case.test_backend.url, "options": case.test_backend.storage_options}
    args["path"] = path
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert (out == "seen elsewhere") == case.backend.cross_process, out
