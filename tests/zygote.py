"""Start ``python -m module ...`` and ``python script.py ...`` as processes forked from one
interpreter that has already imported torch: ``popen`` is ``subprocess.Popen`` for them.

The multi-process suites start hundreds of rank processes, and importing torch and its
distributed checkpointing took most of each start (about 3 CPU-seconds; a test of two starts
of two ranks paid it four times, on a machine of two cores). The zygote is one interpreter
per test process (tests/zygote_server.py; this module is its client) that imports them once
and, asked over a Unix socket, forks a child that becomes ``python [-m] target args`` would:
the working directory, exactly the environment given, ``sys.argv``, and ``sys.path`` as the
interpreter would compute them (the target's directory, then ``PYTHONPATH``, then the
installation's), its own standard streams (pipes, files or /dev/null, passed as file
descriptors), running the target as ``__main__`` and ending through the interpreter's normal
shutdown. The child is an ordinary process: it can be signalled by pid, it exits with the code
(or dies of the signal) ``python`` would, and only the module cache of torch is shared, never a
name the target did not import itself.

What cannot match a fresh interpreter, and so must not be relied on by a target: settings
read once when an interpreter starts (``PYTHONHASHSEED``, ``-X`` options, ``PYTHONUNBUFFERED``)
are those of the zygote, which starts from the test process's own environment; a target's own
``PYTHONWARNINGS`` is applied on top of the zygote's filters.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["PRELOAD", "Forked", "address_of", "popen", "popen_like", "requesters", "run"]

#: what the zygote imports before it forks: the libraries every rank process imports first
#: (never Zephon itself: the code under test imports itself in each process)
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "sqlalchemy.orm",
    "fsspec",
    "s3fs",
)
#: environment variables that torch reads once, when it is imported: a child whose value
#: differs from the test process's gets a zygote started with its value
READ_AT_IMPORT = ("TORCH_CPP_LOG_LEVEL",)

#: the zygote itself: run by path, never imported here (what it imports, every child starts with)
_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_server.py")


class _Zygote:
    """A zygote of this test process, started at first use and ended with it."""

    def __init__(self, preload: tuple[str, ...], at_import: dict[str, str | None]) -> None:
        self._folder = tempfile.mkdtemp(prefix="zephon-zygote-")
        self.address = os.path.join(self._folder, "socket")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        for name, value in at_import.items():
            env.pop(name, None)
            if value is not None:
                env[name] = value
        self._server = subprocess.Popen(
            [sys.executable, _SERVER, self.address, json.dumps(preload)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            cwd=self._folder,
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(self.address):
            if self._server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the zygote did not start (exit {self._server.poll()})")
            time.sleep(0.02)
        atexit.register(self.close)

    def close(self) -> None:
        if self._server.stdin is not None and not self._server.stdin.closed:
            self._server.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._server.wait(timeout=30)
        if self._server.poll() is None:
            self._server.kill()
            self._server.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.address)
            os.rmdir(self._folder)


_zygotes: dict[tuple, _Zygote] = {}
_lock = threading.Lock()


def _zygote_of(preload: tuple[str, ...], env: dict[str, str]) -> _Zygote:
    """The zygote that imported ``preload`` with ``env``'s values of ``READ_AT_IMPORT``,
    started at first use (and again if it died)."""
    at_import = {name: env.get(name) for name in READ_AT_IMPORT}
    key = (preload, tuple(at_import.items()))
    with _lock:
        found = _zygotes.get(key)
        if found is None or found._server.poll() is not None:
            found = _zygotes[key] = _Zygote(preload, at_import)
        return found


_Stream = int | IO[Any] | None


def _child_end(spec: _Stream, number: int) -> tuple[int, int | None]:
    """(the descriptor the child gets as standard stream ``number``, the parent's end of a
    new pipe or None)."""
    reading = number == 0
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        return (read, write) if reading else (write, read)
    if spec == subprocess.DEVNULL or (spec is None and reading):
        return os.open(os.devnull, os.O_RDONLY if reading else os.O_WRONLY), None
    if spec is None:  # inherit, as Popen does
        return os.dup(number), None
    fd = spec if isinstance(spec, int) else spec.fileno()
    return os.dup(fd), None


class Forked:
    """A process the zygote forked, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(
        self,
        args: list[str],
        conn: socket.socket,
        pid: int,
        streams: tuple[IO[Any] | None, IO[Any] | None, IO[Any] | None],
    ) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdin, self.stdout, self.stderr = streams
        self._conn = conn
        self._read: dict[str, list] = {}
        self._readers: list[threading.Thread] = []

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._receive(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def _receive(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` for the zygote's word that the process ended."""
        self._conn.settimeout(timeout)
        try:
            message = self._conn.recv(4096)
        except (TimeoutError, BlockingIOError):
            return False
        finally:
            self._conn.settimeout(None)
        if not message:
            raise RuntimeError(f"the zygote ended before process {self.pid} did")
        self.returncode = json.loads(message)["code"]
        self._conn.close()
        return True

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr to their end and wait, as ``Popen.communicate``; called
        again after ``TimeoutExpired``, it goes on where it stopped."""
        if input is not None:
            assert self.stdin is not None
            self.stdin.write(input)
        if self.stdin is not None and not self.stdin.closed:
            self.stdin.close()
        if not self._readers:
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    parts = self._read.setdefault(name, [])
                    reader = threading.Thread(target=_drain, args=(stream, parts), daemon=True)
                    reader.start()
                    self._readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        found = []
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is None:
                found.append(None)
                continue
            parts = self._read[name]
            found.append(("" if isinstance(stream, io.TextIOBase) else b"").join(parts))
            stream.close()
        return found[0], found[1]

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


def _drain(stream: IO[Any], parts: list) -> None:
    while True:
        chunk = stream.read(65536) if not isinstance(stream, io.TextIOBase) else stream.read()
        if not chunk:
            return
        parts.append(chunk)


def popen(
    target: Sequence[str],
    *,
    cwd: str | Path,
    env: dict[str, str],
    stdin: _Stream = None,
    stdout: _Stream = None,
    stderr: _Stream = None,
    text: bool = False,
    start_new_session: bool = False,
    preload: Sequence[str] = PRELOAD,
    address: str | None = None,
) -> Forked:
    """``subprocess.Popen([sys.executable, *target], ...)`` through the zygote: ``target`` is
    ``["-m", module, *args]`` or ``[script, *args]``; streams as Popen takes them (PIPE,
    DEVNULL, a file or descriptor, None to inherit; stderr also STDOUT); ``-u`` may come
    first, as for python; ``start_new_session`` as Popen's; ``preload``: what the zygote
    imported (one zygote per set: a framework's tests preload the framework too);
    ``address``: a zygote already running (``address_of``), whatever ``preload``."""
    target = list(target)
    unbuffered = target[0] == "-u"
    target = target[1:] if unbuffered else target
    request: dict[str, Any] = {
        "cwd": str(cwd),
        "env": dict(env),
        "new_session": start_new_session,
        "unbuffered": unbuffered,
    }
    if target[0] == "-m":
        request.update(module=target[1], args=target[2:])
    else:
        request.update(script=target[0], args=target[1:])
    ends = [_child_end(spec, number) for number, spec in enumerate((stdin, stdout))]
    together = stderr == subprocess.STDOUT
    ends.append((os.dup(ends[1][0]), None) if together else _child_end(stderr, 2))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(address or _zygote_of(tuple(preload), request["env"]).address)
        socket.send_fds(conn, [json.dumps(request).encode()], [end[0] for end in ends])
        reply = conn.recv(4096)
    except BaseException:
        conn.close()
        for child, parent in ends:
            os.close(child)
            if parent is not None:
                os.close(parent)
        raise
    for child, _ in ends:
        os.close(child)
    if not reply:
        conn.close()
        raise RuntimeError("the zygote refused to start " + " ".join(target))
    streams = []
    for (_, parent), mode in zip(ends, ("w", "r", "r"), strict=True):
        if parent is None:
            streams.append(None)
        elif text:
            streams.append(open(parent, mode, encoding="utf-8", errors="replace"))  # noqa: SIM115
        else:
            streams.append(open(parent, mode + "b", buffering=0 if mode == "w" else -1))  # noqa: SIM115
    return Forked([sys.executable, *target], conn, json.loads(reply)["pid"], tuple(streams))


def requesters() -> dict[int, int]:
    """For every living process a zygote of this test process forked: the pid of the process
    that asked for it (a torchrun agent, for its workers), so that a test that kills a process
    tree can count them as that process's children (tests/zephon/multinode/nodes.py)."""
    found: dict[int, int] = {}
    with _lock:
        addresses = [z.address for z in _zygotes.values() if z._server.poll() is None]
    for address in addresses:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(30)
            conn.connect(address)
            conn.send(json.dumps({"query": True}).encode())
            reply = json.loads(conn.recv(1 << 20))
        found.update({int(child): parent for child, parent in reply["requested_by"].items()})
    return found


def address_of(env: dict[str, str], preload: Sequence[str] = PRELOAD) -> str:
    """The socket of the zygote ``popen(..., env=env, preload=preload)`` would use, started
    if need be: for a child that starts processes of its own through the same zygote
    (tests/torchrun.py)."""
    return _zygote_of(tuple(preload), env).address


def popen_like(preload: Sequence[str] = PRELOAD):
    """A stand-in for ``subprocess.Popen`` for code that starts ``[sys.executable, ...]``
    itself (the demo's ``Ranks``): the same keywords, through the zygote."""

    def start(argv: Sequence[str], *, cwd: str | Path | None = None, **kwargs: Any) -> Forked:
        assert argv[0] == sys.executable, argv
        env = kwargs.pop("env", None)
        return popen(
            argv[1:],
            cwd=os.getcwd() if cwd is None else cwd,
            env=dict(os.environ if env is None else env),
            preload=preload,
            **kwargs,
        )

    return start


def run(
    target: Sequence[str],
    *,
    cwd: str | Path,
    env: dict[str, str],
    timeout: float,
    preload: Sequence[str] = PRELOAD,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *target], capture_output=True, text=True, ...)``
    through the zygote; the process is killed and ``TimeoutExpired`` raised after
    ``timeout`` seconds."""
    process = popen(
        target,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preload=preload,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    assert process.returncode is not None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
