"""Chaos for deduplicated saves: saving jobs and gc processes SIGKILLed at random, and after
every kill the invariants checked on storage alone (docs/dedup.md, "Which chunks are removed,
and why it is safe").

Each round is one restarted job (``chaos_saver``: the checkpoint manager with ``dedup: true``,
a SQLite catalog, ``num_to_keep`` small, a new attempt resuming with ``load_latest``, saving
every step) with gc processes beside it (``chaos_gc``: ``collect_garbage`` pass after pass,
with the given grace); one of them, chosen at random (seeded), is SIGKILLed: at a kill point
of ``chaos_kills`` (among the chunk uploads, between the uploads and the marker, after the
marker, between retention's marker deletion and the chunk sweep, mid-sweep) or at a random
wall-clock moment. Once every process of the round is gone:

- every checkpoint of the run's lineage (``RunStore.complete()``) passes
  ``RunStore.verify(step, deep=True)``: no chunk missing, every CRC32C right;
- the latest (``RunStore.latest()``) exports bit for bit equal to what the saver saved at that
  step (``chaos_saver.expected_state``), read through its chunks with every CRC checked;
- the next round's job loads the latest and checks it as well (exit 3 if it differs).

Used by benchmarks/dedup_chaos.py (100 kills, the table) and
tests/zephon/dedup/test_chaos_dedup.py (a few kills per backend).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.zephon.dedup.chaos_kills import GC_POINTS, SAVER_POINTS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RUN = "chaos"


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """One chaos campaign on one storage root (``url``, empty at the start)."""

    url: str
    storage_options: dict
    workdir: str  # the SQLite catalog and the gc processes' stop files
    kills: int = 100
    seed: int = 0
    num_to_keep: int = 2
    #: saves per job, drawn in this range each round
    saves: tuple[int, int] = (3, 6)
    gc_processes: int = 2
    grace_s: float = 0.0
    pending_grace_s: float = 5.0
    #: share of kills at a kill point (the rest at a random wall-clock moment)
    at_points: float = 0.6
    #: rounds allowed beyond ``kills`` for kill points that were never reached
    max_rounds: int | None = None

    @property
    def catalog(self) -> str:
        return f"sqlite:///{os.path.join(self.workdir, 'catalog.db')}"


@dataclass(slots=True)
class Round:
    """What one round did and found."""

    index: int
    victim: str  # "saver" or "gc"
    plan: str  # the kill point ("before-marker@2") or "wall"
    saves: int = 0  # the saves the job was to make
    killed: bool = False
    how: str = ""  # where the kill landed: the point, or "wall +1.23s"
    resumed: int | None = None
    saved: list[int] = field(default_factory=list)
    latest: int | None = None
    lineage: list[int] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # a process failing without a kill
    seconds: float = 0.0


@dataclass(slots=True)
class ChaosResult:
    rounds: list[Round]
    #: after a final gc pass with grace 0: chunk bytes no marker references, and payload bytes
    #: of saves that are not committed
    unreferenced_chunk_bytes: int = 0
    unreferenced_chunks: int = 0
    uncommitted_payload_bytes: int = 0
    stored_bytes: int = 0
    final_violations: list[str] = field(default_factory=list)

    @property
    def kills(self) -> Counter:
        return Counter(r.victim for r in self.rounds if r.killed)

    @property
    def violations(self) -> list[str]:
        found = [f"round {r.index}: {v}" for r in self.rounds for v in r.violations]
        return found + [f"final: {v}" for v in self.final_violations]

    @property
    def errors(self) -> list[str]:
        return [f"round {r.index}: {e}" for r in self.rounds for e in r.errors]


class Child:
    """A child process whose standard output lines are collected with their arrival time."""

    def __init__(self, module: str, args: dict) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, json.dumps(args)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.stderr = ""
        self._cond = threading.Condition()
        self._out = threading.Thread(target=self._read, daemon=True)
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._out.start()
        self._err.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _read_err(self) -> None:
        self.stderr = self.proc.stderr.read()

    def wait_line(self, prefix: str, timeout: float) -> str | None:
        """The first line starting with ``prefix``, waiting for it; None if the process ended
        (or ``timeout`` passed) without one."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for _, line in self.lines:
                    if line.startswith(prefix):
                        return line
                if not self._out.is_alive() or time.monotonic() > deadline:
                    return None
                self._cond.wait(0.05)

    def kill(self) -> bool:
        """SIGKILL it if it is still running; whether this call killed it."""
        if self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)
        return self.proc.returncode == -signal.SIGKILL

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)
        self._out.join(30)
        self._err.join(30)
        return self.proc.returncode

    def said(self, prefix: str) -> list[str]:
        return [line for _, line in self.lines if line.startswith(prefix)]


def expected_state(step: int):
    from tests.zephon.dedup.chaos_saver import expected_state as expected

    return expected(step)


def check_storage(url: str, storage_options: dict, scratch: str) -> tuple[Round, list[str]]:
    """The invariants, from storage alone: returns a Round holding ``lineage`` and ``latest``,
    and the violations found."""
    import torch
    from safetensors.torch import load_file

    from zephon.checkpointing import export_safetensors
    from zephon.storage import CheckpointStore

    found = Round(index=-1, victim="", plan="")
    violations: list[str] = []
    store = CheckpointStore(url, storage_options)
    run = store.run(RUN)
    manifests = run.complete()
    found.lineage = [m.step for m in manifests]
    for manifest in manifests:
        try:
            report = run.verify(manifest.step, deep=True)
        except Exception as exc:  # noqa: BLE001 - a failure to verify is a finding as well
            violations.append(f"step {manifest.step} ({manifest.save_id}): verify raised {exc!r}")
            continue
        if not report.ok:
            problems = "; ".join(str(p) for p in report.problems[:3])
            violations.append(f"step {manifest.step} ({manifest.save_id}) damaged: {problems}")
    latest = run.latest()
    if latest is None:
        return found, violations
    found.latest = latest.step
    out = tempfile.mkdtemp(prefix="export-", dir=scratch)
    try:
        export_safetensors(store, RUN, latest.step, out)
        loaded = load_file(os.path.join(out, "model.safetensors"))
    except Exception as exc:  # noqa: BLE001
        violations.append(f"latest step {latest.step} ({latest.save_id}) does not load: {exc!r}")
        return found, violations
    want = expected_state(latest.step)
    if set(loaded) != set(want):
        violations.append(f"latest step {latest.step} holds {sorted(loaded)}, not {sorted(want)}")
    for key in sorted(set(loaded) & set(want)):
        if not torch.equal(loaded[key], want[key]):
            violations.append(f"latest step {latest.step}: {key} differs from what was saved")
    return found, violations


def leftovers(url: str, storage_options: dict) -> tuple[int, int, int, int]:
    """(unreferenced chunk instances, their bytes, payload bytes of saves no marker commits,
    bytes stored under the run in all)."""
    from zephon.storage import CheckpointStore

    store = CheckpointStore(url, storage_options)
    run = store.run(RUN)
    backend = store.location.backend
    files = backend.list_files(run.run_path())
    referenced: set[str] = set()
    committed_saves: set[str] = set()
    for listing in run.list_steps():
        if listing.committed:
            manifest = run.read_manifest(listing.step)
            referenced.update(c.name for c in manifest.chunk_refs())
            committed_saves.add(manifest.save_id)
    chunk_dir = run.layout.chunk_dir.rstrip("/") + "/"
    chunks = chunk_bytes = payload = 0
    for f in files:
        name = f.path.rsplit("/", 1)[-1]
        if f.path.startswith(chunk_dir) or f"/{chunk_dir}" in f"/{f.path}":
            if name not in referenced:
                chunks += 1
                chunk_bytes += f.size
            continue
        parts = f.path.split("/")
        saves = [p for p in parts if p.startswith("e") and "-" in p]
        if any(p.startswith("save-") for p in parts) and saves and saves[-1] not in committed_saves:
            payload += f.size
    return chunks, chunk_bytes, payload, sum(f.size for f in files)


def final_gc(config: ChaosConfig) -> None:
    """One gc pass with grace 0 and a pending grace of 0, nothing else running."""
    from zephon.catalog import Catalog
    from zephon.gc import GcPolicy, collect_garbage

    zero = dt.timedelta(0)
    policy = GcPolicy(grace=zero, pending_grace=zero, lease=dt.timedelta(seconds=1))
    time.sleep(1.1)  # a killed gc's claims pass their lease
    with Catalog(config.catalog) as catalog:
        for _ in range(2):  # the second pass finishes what the first settled
            collect_garbage(
                catalog, runs=[RUN], policy=policy, storage_options=config.storage_options
            )


def play_round(config: ChaosConfig, index: int, rng: random.Random, save_s: float) -> Round:
    """One job with gc beside it, one of them SIGKILLed; the invariants checked after."""
    started = time.monotonic()
    victim = rng.choice(("saver", "gc"))
    saves = rng.randint(*config.saves)
    if rng.random() < config.at_points:
        point = rng.choice(SAVER_POINTS if victim == "saver" else GC_POINTS)
        nth = rng.randint(1, saves - 1 if victim == "saver" else 3)
        plan = f"{point}@{nth}"
    else:
        plan = "wall"
    result = Round(index=index, victim=victim, plan=plan, saves=saves)
    base_args = {"url": config.url, "storage_options": config.storage_options, "run": RUN}
    base_args["catalog"] = config.catalog
    saver_args = {**base_args, "num_to_keep": config.num_to_keep, "saves": saves}
    if victim == "saver" and plan != "wall":
        saver_args["kill"] = plan
    gcs: list[Child] = []
    stop = os.path.join(config.workdir, f"stop-{index}")

    def start_gcs() -> None:
        for i in range(config.gc_processes):
            gc_args = {
                **base_args,
                "grace_s": config.grace_s,
                "pending_grace_s": config.pending_grace_s,
                "stop": stop,
            }
            if victim == "gc" and i == 0 and plan != "wall":
                gc_args["kill"] = plan
            gcs.append(Child("tests.zephon.dedup.chaos_gc", gc_args))

    # gc names the run, so it starts once the catalog has it: after the first job's start,
    # then before each job (its passes meet the job's registration, its resume, its saves)
    early = index > 1
    if early:
        start_gcs()
    saver = Child("tests.zephon.dedup.chaos_saver", saver_args)
    resumed = saver.wait_line("resumed", timeout=300)
    if not early and resumed is not None:
        start_gcs()
    target = saver if victim == "saver" else (gcs[0] if gcs else None)
    if plan == "wall" and target is not None:
        delay = rng.uniform(0.0, saves * save_s)
        if victim == "gc" and not early:
            delay += 1.5  # the gc process's own start (imports), so that it is at work
        time.sleep(delay)
        if target.kill():
            result.killed, result.how = True, f"wall +{delay:.2f}s"
    saver_rc = saver.finish(timeout=600)
    # a gc whose kill point was not reached while the job saved: a wall-clock kill instead
    if victim == "gc" and target is not None and target.proc.poll() is None and target.kill():
        result.killed, result.how = True, "wall (after the job)"
    open(stop, "w").close()
    gc_rcs = [gc.finish(timeout=600) for gc in gcs]
    if target is not None and not result.killed and target.proc.returncode == -signal.SIGKILL:
        result.killed = True
        died = target.said("killing at")
        result.how = died[-1].removeprefix("killing at ") if died else plan
    # errors that are not the kill
    if saver_rc == 3:
        result.violations.append(f"the job loaded the wrong state: {saver.stderr[-500:]}")
    elif saver_rc not in (0, -signal.SIGKILL):
        result.errors.append(f"saver exit {saver_rc}: {saver.stderr.strip()[-800:]}")
    for gc, rc in zip(gcs, gc_rcs, strict=True):
        if rc not in (0, -signal.SIGKILL):
            result.errors.append(f"gc exit {rc}: {gc.stderr.strip()[-800:]}")
    if resumed is not None:
        word = resumed.split()[1]
        result.resumed = None if word == "none" else int(word)
    result.saved = [int(line.split()[1]) for line in saver.said("saved")]
    found, violations = check_storage(config.url, config.storage_options, config.workdir)
    result.latest, result.lineage = found.latest, found.lineage
    result.violations.extend(violations)
    result.seconds = time.monotonic() - started
    return result


def run_chaos(config: ChaosConfig, progress: Callable[[Round], None] = lambda r: None):
    """Rounds until ``config.kills`` kills (a round whose kill point was never reached kills
    nothing), then a final gc with grace 0 and the leftovers measured. Stops at the first
    round with a violation: what it found is the report."""
    os.makedirs(config.workdir, exist_ok=True)
    rng = random.Random(config.seed)
    rounds: list[Round] = []
    save_s = 0.4
    limit = config.max_rounds if config.max_rounds is not None else 2 * config.kills + 5
    while sum(r.killed for r in rounds) < config.kills and len(rounds) < limit:
        played = play_round(config, len(rounds) + 1, rng, save_s)
        rounds.append(played)
        progress(played)
        if len(played.saved) >= 2:  # the job's pace, for the next wall-clock kill
            save_s = 0.7 * save_s + 0.3 * (played.seconds / (len(played.saved) + 6))
        if played.violations:
            break
    result = ChaosResult(rounds=rounds)
    if not result.violations:
        final_gc(config)
        found, violations = check_storage(config.url, config.storage_options, config.workdir)
        result.final_violations = violations
    counts = leftovers(config.url, config.storage_options)
    result.unreferenced_chunks, result.unreferenced_chunk_bytes = counts[0], counts[1]
    result.uncommitted_payload_bytes, result.stored_bytes = counts[2], counts[3]
    return result


def landed(r: Round) -> str:
    """Where a round's kill landed: a kill point's name, "wall", or "none"."""
    if not r.killed:
        return "none"
    return "wall" if r.how.startswith("wall") else r.how.split("@")[0]


def summary_rows(result: ChaosResult) -> list[tuple]:
    """One row per victim and where the kill landed: rounds, kills, violations."""
    groups: dict[tuple[str, str], list[Round]] = {}
    for r in result.rounds:
        groups.setdefault((r.victim, landed(r)), []).append(r)
    rows = []
    for (victim, point), rs in sorted(groups.items()):
        rows.append(
            (
                victim,
                point,
                len(rs),
                sum(r.killed for r in rs),
                sum(len(r.violations) for r in rs),
            )
        )
    return rows
