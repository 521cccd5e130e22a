"""The memory tier's peer transport (zephon/destinations/memory/peer*.py) over real sockets on
127.0.0.1: round trips, atomic and checked puts and fetches, paths kept inside the served
directory, the token, dead and killed peers, parallel clients and hostile bytes.

Hostile requests are sent by ``RawPeer``, which speaks the documented framing by hand (a
4-byte big-endian length, a JSON object; raw bytes after a ``put``'s first reply), so that the
server's own checks are exercised, not the client's."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from zephon import ZephonError
from zephon.destinations.memory.peer import (
    PeerClient,
    PeerError,
    PeerServer,
    PeerTransferError,
    PeerUnavailableError,
)
from zephon.errors import UsageError
from zephon.storage import Crc32c, crc32c_of

TOKEN = "s3cr3t-job-token-4f9a"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@pytest.fixture
def root(tmp_path) -> str:
    path = tmp_path / "memory"
    path.mkdir()
    return str(path)


@pytest.fixture
def server(root) -> Iterator[PeerServer]:
    with PeerServer(root, TOKEN, host="127.0.0.1") as served:
        yield served


@pytest.fixture
def client(server) -> Iterator[PeerClient]:
    with PeerClient(server.address, TOKEN, timeout_s=30) as connected:
        yield connected


def write_file(path: str, size: int, *, seed: int = 0) -> str:
    """A file of ``size`` bytes of varied content, written 1 MiB at a time; its CRC32C."""
    crc = Crc32c()
    cycle = bytes(range(seed % 251, 251)) + bytes(range(seed % 251))
    block = (cycle * ((1 << 20) // 251 + 1))[: 1 << 20]
    with open(path, "wb") as handle:
        left = size
        while left:
            piece = block[: min(left, len(block))]
            handle.write(piece)
            crc.update(piece)
            left -= len(piece)
            block = block[1:] + block[:1]  # each MiB differs
    return crc.encoded()


def read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def files_under(path: str) -> list[str]:
    """Every file and link under ``path`` (relative), temporary ones included."""
    found = []
    for top, dirs, names in os.walk(path):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            found.append(os.path.relpath(os.path.join(top, name), path))
    return sorted(found)


def part_files(path: str) -> list[str]:
    return [name for name in files_under(path) if name.endswith(".peer-part")]


def eventually(check, timeout: float = 10.0) -> None:
    """Wait for ``check()`` to hold (the server cleans up on its connection's thread)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.02)


class RawPeer:
    """A client speaking the framing by hand, to send what ``PeerClient`` never would."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=10)

    def send(self, message: object) -> None:
        body = json.dumps(message).encode()
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def reply(self) -> dict | None:
        """The next reply, or None if the server closed the connection."""
        head = self._exact(4)
        if head is None:
            return None
        body = self._exact(struct.unpack(">I", head)[0])
        return json.loads(body)

    def end(self) -> None:
        """Send no more (the server may have reset the connection already)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1 << 16) == b""
        except ConnectionResetError:
            return True

    def hello(self, token: str = TOKEN) -> dict | None:
        self.send({"op": "hello", "version": 1, "token": token})
        return self.reply()

    def _exact(self, count: int) -> bytes | None:
        data = b""
        while len(data) < count:
            try:
                piece = self.sock.recv(count - len(data))
            except ConnectionResetError:
                return None
            if not piece:
                return None
            data += piece
        return data

    def close(self) -> None:
        self.sock.close()


# -- round trips ----------------------------------------------------------------------------------


def test_put_fetch_range_listing_and_delete_round_trip(tmp_path, root, client):
    source = str(tmp_path / "shard.bin")
    crc = write_file(source, 3_000_000)
    client.put_file(source, "run/step_10/rank0.distcp", crc, 3_000_000)
    client.put_bytes(b'{"step": 10}', "run/step_10/.metadata")
    client.put_bytes(b"done", "run/step_10/marker", crc32c_of(b"done"))

    assert read(os.path.join(root, "run/step_10/rank0.distcp")) == read(source)
    assert client.listing("") == [
        ("run/step_10/.metadata", 12),
        ("run/step_10/marker", 4),
        ("run/step_10/rank0.distcp", 3_000_000),
    ]
    assert client.listing("run/step_10/marker") == [("run/step_10/marker", 4)]
    assert client.listing("run/step_99") == []

    dest = str(tmp_path / "back" / "deep" / "rank0.distcp")
    client.fetch_file("run/step_10/rank0.distcp", dest, crc, 3_000_000)
    assert read(dest) == read(source)
    assert part_files(str(tmp_path / "back")) == []
    with open(source, "rb") as handle:
        handle.seek(1_234_567)
        assert client.read_range("run/step_10/rank0.distcp", 1_234_567, 100_000) == handle.read(
            100_000
        )
    assert client.read_range("run/step_10/marker", 0, 4) == b"done"

    client.put_bytes(b"other", "run/step_20/marker")
    client.delete("run/step_10")
    client.delete("run/step_10")  # idempotent
    assert client.listing("") == [("run/step_20/marker", 5)]
    assert not os.path.exists(os.path.join(root, "run/step_10"))
    client.delete("run/step_20/marker")  # a single file
    assert client.listing("") == []


def test_a_put_replaces_the_previous_file_atomically(root, client):
    client.put_bytes(b"first version", "doc.json")
    client.put_bytes(b"second", "doc.json")
    assert read(os.path.join(root, "doc.json")) == b"second"
    assert files_under(root) == ["doc.json"]


def test_zero_bytes_round_trip(tmp_path, root, client):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    client.put_file(str(empty), "a/empty.bin", crc32c_of(b""), 0)
    client.put_bytes(b"", "a/empty.json")
    assert client.listing("a") == [("a/empty.bin", 0), ("a/empty.json", 0)]
    dest = tmp_path / "out" / "empty.bin"
    client.fetch_file("a/empty.bin", str(dest), crc32c_of(b""), 0)
    assert dest.read_bytes() == b""
    assert client.read_range("a/empty.bin", 0, 0) == b""
    assert os.path.getsize(os.path.join(root, "a/empty.bin")) == 0


def test_64_mib_round_trip_with_bounded_peak_memory(tmp_path, root, client):
    size = 64 << 20
    source = str(tmp_path / "big.bin")
    crc = write_file(source, size, seed=3)
    dest = str(tmp_path / "fetched.bin")
    tracemalloc.start()
    try:
        client.put_file(source, "big/rank0.distcp", crc, size)
        client.fetch_file("big/rank0.distcp", dest, crc, size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # both ends run in this process: each holds about one 4 MiB chunk, never the file
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB for a 64 MiB transfer"
    assert os.path.getsize(os.path.join(root, "big/rank0.distcp")) == size
    assert Crc32c_of_file(dest) == crc


def Crc32c_of_file(path: str) -> str:  # noqa: N802 (reads as the checksum it returns)
    crc = Crc32c()
    with open(path, "rb") as handle:
        while piece := handle.read(1 << 20):
            crc.update(piece)
    return crc.encoded()


# -- checked transfers ----------------------------------------------------------------------------


def test_a_put_with_a_wrong_crc_leaves_nothing(tmp_path, root, client):
    source = str(tmp_path / "shard.bin")
    write_file(source, 1_000_000)
    client.put_bytes(b"old", "run/shard.bin")
    with pytest.raises(PeerTransferError) as caught:
        client.put_file(source, "run/shard.bin", crc32c_of(b"something else"), 1_000_000)
    message = str(caught.value)
    assert "run/shard.bin" in message and f"{client.peer}" in message and "CRC32C" in message
    assert caught.value.peer == client.peer
    eventually(lambda: part_files(root) == [])
    assert read(os.path.join(root, "run/shard.bin")) == b"old"  # not replaced
    with pytest.raises(PeerTransferError):
        client.put_bytes(b"new", "run/fresh.json", crc32c_of(b"not new"))
    eventually(lambda: files_under(root) == ["run/shard.bin"])
    client.put_bytes(b"new", "run/fresh.json")  # the client carries on, on a new connection
    assert client.listing("run") == [("run/fresh.json", 3), ("run/shard.bin", 3)]


def test_a_local_file_of_another_size_is_refused_before_sending(tmp_path, root, client):
    source = str(tmp_path / "shard.bin")
    crc = write_file(source, 1000)
    with pytest.raises(PeerTransferError, match="1000 bytes, not the 999 declared"):
        client.put_file(source, "shard.bin", crc, 999)
    assert files_under(root) == []


def test_a_lying_client_that_sends_fewer_bytes_than_declared_leaves_nothing(server, root):
    raw = RawPeer(server.address)
    assert raw.hello() == {"ok": True}
    raw.send({"op": "put", "path": "run/shard.bin", "size": 100, "crc32c": crc32c_of(b"x" * 100)})
    assert raw.reply() == {"ok": True}
    raw.sock.sendall(b"x" * 50)
    eventually(lambda: len(part_files(root)) == 1)  # received under a temporary name only
    raw.end()  # the stream ends 50 bytes short
    assert raw.closed_by_server()
    raw.close()
    eventually(lambda: files_under(root) == [])
    assert os.path.isdir(os.path.join(root, "run"))


def test_a_lying_client_that_sends_more_bytes_than_declared_is_refused(server, root):
    payload = b"y" * 50
    raw = RawPeer(server.address)
    raw.hello()
    raw.send({"op": "put", "path": "shard.bin", "size": 10, "crc32c": crc32c_of(payload)})
    assert raw.reply() == {"ok": True}
    raw.sock.sendall(payload)
    reply = raw.reply()  # the refusal, unless the reset for the unread bytes overtook it
    assert reply is None or (reply["ok"] is False and "CRC32C" in reply["error"])
    assert raw.closed_by_server()
    raw.close()
    eventually(lambda: files_under(root) == [])


def test_a_fetch_of_other_bytes_than_expected_leaves_nothing(tmp_path, client):
    client.put_bytes(b"the peer's bytes", "doc.json")
    dest = tmp_path / "out" / "doc.json"
    with pytest.raises(PeerTransferError, match="CRC32C") as caught:
        client.fetch_file("doc.json", str(dest), crc32c_of(b"the wanted bytes"), 16)
    assert "doc.json" in str(caught.value) and client.peer in str(caught.value)
    with pytest.raises(PeerTransferError, match="holds 16 bytes, not 17"):
        client.fetch_file("doc.json", str(dest), crc32c_of(b"x"), 17)
    assert files_under(str(tmp_path / "out")) == []
    with pytest.raises(PeerTransferError, match="no file 'missing.json'"):
        client.fetch_file("missing.json", str(dest), crc32c_of(b""), 0)
    with pytest.raises(PeerTransferError, match="outside its 16 bytes"):
        client.read_range("doc.json", 10, 7)


# -- paths ----------------------------------------------------------------------------------------

ESCAPES = [
    "../outside/x",
    "a/../../outside/x",
    "a/../b",
    "/tmp/x",
    "a\\..\\b",
    "a\x00b",
    "a//b",
    "./a",
    "a/",
    "a/.hidden.peer-part",
    "",
]


@pytest.mark.parametrize("relpath", ESCAPES)
def test_the_server_refuses_a_path_that_is_not_relative_and_normal(tmp_path, server, root, relpath):
    outside = tmp_path / "outside"
    outside.mkdir()
    for request in (
        {"op": "put", "path": relpath, "size": 1, "crc32c": crc32c_of(b"z")},
        {"op": "fetch", "path": relpath},
        {"op": "read", "path": relpath, "offset": 0, "length": 1},
        {"op": "delete", "path": relpath},
    ):
        raw = RawPeer(server.address)
        raw.hello()
        raw.send(request)
        reply = raw.reply()
        assert reply is not None and reply["ok"] is False and "refused" in reply["error"], request
        assert raw.closed_by_server()
        raw.close()
    assert files_under(root) == [] and files_under(str(outside)) == []


@pytest.mark.parametrize("relpath", ESCAPES[:-1])
def test_the_client_refuses_the_same_paths_before_sending(client, relpath):
    with pytest.raises(UsageError):
        client.put_bytes(b"z", relpath)
    with pytest.raises(UsageError):
        client.delete(relpath)


def test_a_symlink_out_of_root_is_not_followed(tmp_path, root, client):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not yours")
    os.symlink(str(outside), os.path.join(root, "escape"))
    os.symlink(str(outside / "secret"), os.path.join(root, "secret_link"))
    with pytest.raises(PeerTransferError, match="outside the served directory"):
        client.put_bytes(b"planted", "escape/planted")
    with pytest.raises(PeerTransferError, match="outside the served directory"):
        client.fetch_file("secret_link", str(tmp_path / "got"), crc32c_of(b"not yours"), 9)
    with pytest.raises(PeerTransferError, match="outside the served directory"):
        client.read_range("escape/secret", 0, 9)
    with pytest.raises(PeerTransferError, match="outside the served directory"):
        client.delete("escape")
    with pytest.raises(PeerTransferError, match="outside the served directory"):
        client.listing("escape")
    assert client.listing("") == []  # links are not listed, nor followed
    assert sorted(os.listdir(outside)) == ["secret"]
    assert not (tmp_path / "got").exists()
    # a link that stays inside is served
    client.put_bytes(b"inside", "real/doc")
    os.symlink(os.path.join(root, "real"), os.path.join(root, "alias"))
    assert client.read_range("alias/doc", 0, 6) == b"inside"


# -- the token ------------------------------------------------------------------------------------


def test_a_wrong_token_is_refused_without_touching_disk(server, root):
    intruder = PeerClient(server.address, "guessed-token", timeout_s=5)
    with pytest.raises(PeerTransferError, match="refused the connection") as caught:
        intruder.put_bytes(b"planted", "planted.json")
    assert "guessed-token" not in str(caught.value) and TOKEN not in str(caught.value)
    with pytest.raises(PeerTransferError):
        intruder.delete("anything")
    intruder.close()
    # a request sent before (or instead of) the hello is refused too
    for first in (
        {"op": "put", "path": "planted.json", "size": 1, "crc32c": crc32c_of(b"p")},
        {"op": "hello", "version": 1},
        {"op": "hello", "version": 1, "token": 12345},
        {"op": "hello", "version": 1, "token": TOKEN[:-1]},
    ):
        raw = RawPeer(server.address)
        raw.send(first)
        reply = raw.reply()
        assert reply is not None and reply["ok"] is False, first
        assert TOKEN not in json.dumps(reply)
        assert raw.closed_by_server()
        raw.close()
    assert files_under(root) == []


# -- dead, stalled and killed peers ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_refused_connection_is_reported_at_once():
    port = free_port()
    client = PeerClient(("127.0.0.1", port), TOKEN, timeout_s=30)
    started = time.monotonic()
    with pytest.raises(PeerUnavailableError, match=f"127.0.0.1:{port}.*refused") as caught:
        client.listing("")
    assert time.monotonic() - started < 1.0
    assert caught.value.peer == f"127.0.0.1:{port}"
    assert isinstance(caught.value, PeerError) and isinstance(caught.value, ZephonError)
    copy = pickle.loads(pickle.dumps(caught.value))  # as sent from one rank to the others
    assert type(copy) is PeerUnavailableError and copy.peer == caught.value.peer
    assert str(copy) == str(caught.value)


def test_a_peer_that_does_not_answer_is_reported_within_the_timeout():
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    try:
        client = PeerClient(silent.getsockname()[:2], TOKEN, timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(PeerUnavailableError, match="no answer within 0.5s"):
            client.put_bytes(b"x", "x")
        assert time.monotonic() - started < 5.0
    finally:
        silent.close()


@pytest.fixture
def server_process(root) -> Iterator[tuple[subprocess.Popen, tuple[str, int]]]:
    """A ``PeerServer`` on ``root`` in a process of its own, to be killed."""
    code = (
        "import sys, time\n"
        "from zephon.destinations.memory.peer import PeerServer\n"
        "server = PeerServer(sys.argv[1], sys.argv[2], host='127.0.0.1')\n"
        "print(server.address[1], flush=True)\n"
        "time.sleep(600)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, root, TOKEN], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        port = int(process.stdout.readline())
        yield process, ("127.0.0.1", port)
    finally:
        process.kill()
        process.wait()


def run_in_thread(fn) -> tuple[threading.Thread, list[BaseException | None]]:
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 (handed to the test)
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def kill_when_under_way(process: subprocess.Popen, directory: str) -> None:
    """SIGKILL ``process`` once a temporary file in ``directory`` has received bytes."""
    eventually(
        lambda: any(
            os.path.getsize(os.path.join(directory, name)) > 0 for name in part_files(directory)
        ),
        timeout=60,
    )
    process.send_signal(signal.SIGKILL)


@pytest.mark.slow
def test_a_server_killed_during_a_put_gives_an_error_not_a_hang(tmp_path, root, server_process):
    process, address = server_process
    source = str(tmp_path / "sparse.bin")
    size = 4 << 30  # sparse: cheap to read, long enough to be cut short
    with open(source, "wb") as handle:
        handle.truncate(size)
    client = PeerClient(address, TOKEN, timeout_s=10)
    thread, outcome = run_in_thread(
        lambda: client.put_file(source, "big/rank0.distcp", crc32c_of(b""), size)
    )
    kill_when_under_way(process, os.path.join(root, "big"))
    thread.join(timeout=30)
    assert not thread.is_alive(), "the put hung after its peer was killed"
    assert isinstance(outcome[0], PeerUnavailableError), outcome
    assert address[0] in str(outcome[0]) and str(address[1]) in str(outcome[0])
    assert not os.path.exists(os.path.join(root, "big/rank0.distcp"))


@pytest.mark.slow
def test_a_server_killed_during_a_fetch_gives_an_error_not_a_hang(tmp_path, root, server_process):
    process, address = server_process
    size = 4 << 30
    with open(os.path.join(root, "sparse.bin"), "wb") as handle:
        handle.truncate(size)
    client = PeerClient(address, TOKEN, timeout_s=10)
    dest_dir = str(tmp_path / "dest")
    os.makedirs(dest_dir)
    thread, outcome = run_in_thread(
        lambda: client.fetch_file("sparse.bin", f"{dest_dir}/sparse.bin", crc32c_of(b""), size)
    )
    kill_when_under_way(process, dest_dir)
    thread.join(timeout=30)
    assert not thread.is_alive(), "the fetch hung after its peer was killed"
    assert isinstance(outcome[0], PeerUnavailableError), outcome
    assert os.listdir(dest_dir) == []  # neither the file nor its temporary


def stopped(pid: int) -> bool:
    """Whether process ``pid`` has stopped (SIGSTOP is delivered asynchronously)."""
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_a_stopped_server_is_reported_within_the_timeout_once(server_process):
    process, address = server_process
    client = PeerClient(address, TOKEN, timeout_s=2)
    client.put_bytes(b"1", "one")  # the connection is open
    process.send_signal(signal.SIGSTOP)  # a peer frozen or cut off: no reply, no reset
    try:
        eventually(lambda: stopped(process.pid))
        started = time.monotonic()
        with pytest.raises(PeerUnavailableError, match="no answer within 2s"):
            client.listing("")
        assert time.monotonic() - started < 3.5  # noticed once: not waited for again anew
    finally:
        process.send_signal(signal.SIGCONT)
    assert client.listing("") == [("one", 1)]  # back: a new connection
    client.close()


def test_a_closed_server_is_reported_and_a_restarted_one_is_reconnected(root):
    server = PeerServer(root, TOKEN, host="127.0.0.1")
    client = PeerClient(server.address, TOKEN, timeout_s=5)
    client.put_bytes(b"1", "one")
    server.close()
    port = server.address[1]
    assert not [t for t in threading.enumerate() if t.name.endswith(f"-{port}")]
    with pytest.raises(PeerUnavailableError):
        client.put_bytes(b"2", "two")
    restarted = PeerServer(root, TOKEN, host="127.0.0.1", port=server.address[1])
    try:
        client.put_bytes(b"3", "three")
        assert client.listing("") == [("one", 1), ("three", 1)]
    finally:
        client.close()
        restarted.close()


def test_a_reused_connection_closed_by_a_restarted_peer_is_opened_anew(root):
    server = PeerServer(root, TOKEN, host="127.0.0.1")
    port = server.address[1]
    client = PeerClient(server.address, TOKEN, timeout_s=5)
    client.put_bytes(b"1", "one")  # the connection is open, idle
    server.close()
    restarted = PeerServer(root, TOKEN, host="127.0.0.1", port=port)
    try:
        assert client.listing("") == [("one", 1)]  # no error: sent again on a new connection
    finally:
        client.close()
        restarted.close()


# -- several clients, hostile bytes ---------------------------------------------------------------


def test_several_clients_are_served_at_once(tmp_path, server, root):
    idle = PeerClient(server.address, TOKEN, timeout_s=10)
    idle.put_bytes(b"held", "idle/doc")  # keeps its connection open meanwhile
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            with PeerClient(server.address, TOKEN, timeout_s=30) as mine:
                source = str(tmp_path / f"src{n}")
                crc = write_file(source, 2_000_000 + n, seed=n)
                for round_ in range(3):
                    mine.put_file(source, f"rank{n}/file{round_}", crc, 2_000_000 + n)
                dest = str(tmp_path / f"dest{n}")
                mine.fetch_file(f"rank{n}/file2", dest, crc, 2_000_000 + n)
                assert read(dest) == read(source)
        except BaseException as error:  # noqa: BLE001 (checked below)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    listed = idle.listing("")
    assert len(listed) == 8 * 3 + 1
    assert ("rank5/file1", 2_000_005) in listed
    idle.close()


@pytest.mark.parametrize(
    ("garbage", "answered"),
    [
        (b"\x00\x00\x00\x05hello", True),  # not JSON
        (b"\x00\x00\x00\x02[]", True),  # JSON, not an object
        (b"\xff\xff\xff\xff", True),  # a 4 GiB frame announced: refused, not awaited
        (b"\x00\x00\x00\x04\xff\xfe\xfd\xfc", True),  # not UTF-8
        (struct.pack(">I", 60_000) + b"[" * 60_000, True),  # nested past the parser's depth
        (bytes(range(256)) * 16, False),  # the reset for the unread bytes may overtake a reply
        (b"\x00\x00", False),  # cut short
    ],
)
def test_the_server_survives_garbage(server, root, client, garbage, answered):
    for authenticated in (False, True):
        raw = RawPeer(server.address)
        if authenticated:
            assert raw.hello() == {"ok": True}
        raw.sock.sendall(garbage)
        if answered:
            reply = raw.reply()
            assert reply is not None and reply["ok"] is False and "protocol" in reply["error"]
        raw.end()
        while (reply := raw.reply()) is not None:
            assert reply["ok"] is False
        raw.close()
    # bad requests after a good hello: unknown op, wrong types
    for request in (
        {"op": "exec", "path": "x"},
        {"op": "put", "path": "x", "size": "1", "crc32c": crc32c_of(b"1")},
        {"op": "put", "path": "x", "size": -1, "crc32c": crc32c_of(b"1")},
        {"op": "put", "path": "x", "size": 1, "crc32c": "not a crc"},
        {"op": "read", "path": "x", "offset": 0, "length": True},
        {"op": "list", "prefix": ["x"]},
    ):
        raw = RawPeer(server.address)
        raw.hello()
        raw.send(request)
        reply = raw.reply()
        assert reply is not None and reply["ok"] is False, request
        raw.close()
    client.put_bytes(b"still serving", "after.json")
    assert client.read_range("after.json", 0, 13) == b"still serving"
    assert files_under(root) == ["after.json"]


def test_bad_arguments_are_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="token"):
        PeerServer(str(tmp_path), "")
    with pytest.raises(UsageError, match="token"):
        PeerClient(("127.0.0.1", 1), "")
    with pytest.raises(UsageError, match="timeout_s"):
        PeerClient(("127.0.0.1", 1), TOKEN, timeout_s=0)
    client = PeerClient(("127.0.0.1", 1), TOKEN)
    with pytest.raises(UsageError, match="crc32c"):
        client.put_bytes(b"x", "x", "nope")
    with pytest.raises(UsageError, match="offset"):
        client.read_range("x", -1, 1)
