"""Judging a deletion claim's holder: gone (no such pid, a zombie, a pid reused since the
claim), alive, or beyond this host's sight (another host, a custom actor)."""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import subprocess
import time

from zephon.holders import Holder, judge_holder

HOST = socket.gethostname()


def token(pid: int, host: str = HOST) -> str:
    return f"someone@{host}:{pid}/0123456789ab"


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def test_a_live_process_that_made_the_claim_is_alive_and_gone_once_it_exited():
    claimed_at = now() + dt.timedelta(seconds=5)  # the process started before its claim
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert judge_holder(token(proc.pid), claimed_at) is Holder.ALIVE
    finally:
        proc.kill()
        proc.wait()
    assert judge_holder(token(proc.pid), claimed_at) is Holder.GONE


def test_a_killed_holder_not_yet_reaped_is_gone():
    proc = subprocess.Popen(["sleep", "30"])
    claimed_at = now() + dt.timedelta(seconds=5)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert judge_holder(token(proc.pid), claimed_at) is Holder.GONE
    finally:
        proc.wait()


def test_a_pid_now_held_by_a_process_started_after_the_claim_is_gone():
    claimed_at = now() - dt.timedelta(minutes=5)  # the claimant had this pid back then
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert judge_holder(token(proc.pid), claimed_at) is Holder.GONE
    finally:
        proc.kill()
        proc.wait()


def test_this_process_is_alive_and_other_hosts_or_actors_cannot_be_judged():
    assert judge_holder(token(os.getpid()), now() - dt.timedelta(days=1)) is Holder.ALIVE
    assert judge_holder(token(1, host=f"not-{HOST}"), now()) is Holder.UNKNOWN
    assert judge_holder("nightly-gc/0123456789ab", now()) is Holder.UNKNOWN
    assert judge_holder(token(2**31 + 5), now()) is Holder.UNKNOWN  # no pid of this kernel
