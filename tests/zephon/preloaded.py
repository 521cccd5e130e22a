"""Run Python scripts in processes forked from one interpreter that has already imported torch.

The docs tests run every Python block of the pages in a process of its own. Importing torch
took most of each run (about 4 CPU-seconds, tens of seconds of wall time on a loaded machine),
once per block. ``PreloadedPython`` starts one interpreter per test process that imports torch
(nothing of Zephon, whose imports read the block's own environment) and forks it for each
script: the child takes the script's working directory, environment, ``sys.argv`` and
``sys.path[0]`` as ``python script.py`` would, runs it as ``__main__`` and exits through the
interpreter's normal shutdown (atexit handlers, non-daemon threads joined). A block still
runs in a process of its own with only the names it imports: a missing ``import torch``
fails with NameError as before; only the module cache of torch is shared.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Completed", "PreloadedPython"]

_SERVER = r"""
import json, os, runpy, sys, traceback

import torch  # noqa: F401 - the import every script would pay for

def child(request):
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        script = request["script"]
        sys.argv = [script]
        sys.path[0] = os.path.dirname(script)
    except BaseException:
        traceback.print_exc()
        os._exit(70)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)
    raise SystemExit(0)

for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        child(request)  # exits through the interpreter's shutdown
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


@dataclass(frozen=True)
class Completed:
    """What ``subprocess.run`` would have returned for ``python script``."""

    returncode: int
    stdout: str
    stderr: str


class PreloadedPython:
    """One preloaded interpreter (see the module docstring); ``run`` one script at a time."""

    def __init__(self, env: dict[str, str]) -> None:
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        #: where each run's output goes (not its working directory, which the script may list)
        self._outputs = Path(tempfile.mkdtemp(prefix="zephon-preloaded-"))

    def _reply(self, deadline: float | None) -> dict:
        out = self._server.stdout
        assert out is not None
        if deadline is not None:
            ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
        line = out.readline()
        if not line:
            raise RuntimeError(f"the preloaded interpreter exited ({self._server.poll()})")
        return json.loads(line)

    def run(self, script: Path, cwd: Path, env: dict[str, str], timeout: float) -> Completed:
        """Run ``script`` as ``python script`` would, in ``cwd`` with exactly ``env``;
        ``subprocess.TimeoutExpired`` (the run killed) after ``timeout`` seconds."""
        stdout, stderr = self._outputs / "stdout", self._outputs / "stderr"
        request = {
            "script": str(script),
            "cwd": str(cwd),
            "env": env,
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        assert self._server.stdin is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = self._reply(None)["pid"]
        try:
            code = self._reply(deadline)["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._reply(None)
            raise subprocess.TimeoutExpired([str(script)], timeout) from None
        try:
            return Completed(code, stdout.read_text(), stderr.read_text())
        finally:
            stdout.unlink()
            stderr.unlink()

    def close(self) -> None:
        if self._server.stdin is not None:
            self._server.stdin.close()
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        shutil.rmtree(self._outputs, ignore_errors=True)
