"""The zygote (tests/zygote.py) starts a process that behaves as ``python [-m] target`` would:
what the multi-process suites rely on when their ranks are forked instead of started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests import zygote

PROBE = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "extra": sys.path[1],
    "env": os.environ.get("PROBE_VALUE"),
    "absent": "NOT_GIVEN" in os.environ,
    "name": __name__,
    "torch": "torch" in sys.modules,
    "zephon": any(m == "zephon" or m.startswith("zephon.") for m in sys.modules),
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NOT_GIVEN"}
    return {**env, **extra}


def test_a_script_gets_its_argv_cwd_path_environment_streams_and_exit_code(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.environ["NOT_GIVEN"] = "1"  # in the test process, not in the child's environment
    try:
        env = _env(PROBE_VALUE="seen", PYTHONPATH=str(elsewhere))
        done = zygote.run([str(script), "3", "b"], cwd=elsewhere, env=env, timeout=120)
    finally:
        del os.environ["NOT_GIVEN"]
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == ["3", "b"] and seen["cwd"] == str(elsewhere)
    assert seen["path0"] == str(tmp_path) and seen["extra"] == str(elsewhere)
    assert seen["env"] == "seen" and seen["absent"] is False and seen["name"] == "__main__"
    assert seen["torch"] is True and seen["zephon"] is False  # only the preload is shared
    assert done.stderr == "to stderr\n"


def test_a_module_runs_as_main_from_the_working_directory(tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    done = zygote.run(["-m", "probe_module", "0"], cwd=tmp_path, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["path0"] == str(tmp_path) and seen["name"] == "__main__"


def test_an_exception_exits_1_with_its_traceback(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("raise ValueError('no good')\n")
    done = zygote.run([str(script)], cwd=tmp_path, env=_env(), timeout=120)
    assert done.returncode == 1 and "ValueError: no good" in done.stderr


def test_a_signal_ends_it_as_it_would_a_process_popen_started(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    child = zygote.popen(
        [str(script)],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stdout.readline() == "ready\n"
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert os.getpgid(child.pid) == child.pid  # its own session, as Popen's option gives
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM
    child.stdout.close()


def test_stdin_and_unbuffered_output_reach_the_parent_line_by_line(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import sys\nfor line in sys.stdin:\n    print(line.strip().upper())\n")
    child = zygote.popen(
        ["-u", str(script)],
        cwd=tmp_path,
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    child.stdin.write(b"first\n")
    started = time.monotonic()
    assert child.stdout.readline() == b"FIRST\n"  # -u: before stdin is closed
    assert time.monotonic() - started < 30
    out, _ = child.communicate(b"second\n", timeout=60)
    assert out == b"SECOND\n" and child.returncode == 0


def test_a_child_started_at_anothers_request_counts_as_its_child(tmp_path):
    """What tests/torchrun.py relies on: a process asking the zygote for a child (torchrun's
    agent, for a worker) is its parent to ``requesters`` and to the tree a test kills."""
    from tests.zephon.multinode.nodes import descendants

    script = tmp_path / "asks.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from tests import zygote\n"
        "child = zygote.popen([sys.argv[3]], cwd='.', env=dict(os.environ), address=sys.argv[1])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(120)\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    address = zygote.address_of(_env())
    asking = zygote.popen(
        [str(script), address, repo, str(sleeper)],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        grandchild = int(asking.stdout.readline())
        assert zygote.requesters()[grandchild] == asking.pid
        assert descendants(asking.pid) == [asking.pid, grandchild]
    finally:
        for pid in descendants(asking.pid)[::-1]:
            os.kill(pid, signal.SIGKILL)
        asking.communicate(timeout=30)
    assert asking.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while grandchild in zygote.requesters():  # reaped by the zygote
        assert time.monotonic() < deadline
        time.sleep(0.05)
