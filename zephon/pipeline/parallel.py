"""Where map functions run: on the reading thread, on a thread pool, or in worker processes.

A lane reader asks a *mapper* for the mapped records of window entries ``[lo, hi)``: ``submit``
returns a handle at once, ``result`` waits for it. Readers of several lanes share one mapper and
may take results in any order. What comes back is a pure function of the window and the range,
so a mapper changes when and where maps run, never what they produce:

- ``InlineMapper`` maps when the result is asked for, on the calling thread (``parallelism=1``);
- ``ThreadMapper`` maps on a thread pool: for maps that wait on I/O or release the GIL;
- ``ProcessMapper`` maps in spawned worker processes, which is what gives pure-Python maps (a
  tokenizer) more than one core. Work units are runs of whole microbatches of at least ``UNIT``
  records, so pickling costs little against mapping; records and results cross a pipe, map
  functions are pickled once per worker.

Progress is counted only when the consumer takes a batch (``Iteration``), so none of this
touches checkpoint state.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import compress, repeat
from operator import is_, is_not
from typing import TYPE_CHECKING, Any

from zephon.pipeline.errors import PipelineError

if TYPE_CHECKING:
    from zephon.pipeline.lanes import Window
    from zephon.pipeline.operators import Operator, PrefetchSpec

__all__ = [
    "InlineMapper",
    "MapStage",
    "Mapper",
    "ProcessMapper",
    "ThreadMapper",
    "apply_maps",
    "make_mapper",
    "map_stage",
]

UNIT = 512  # fewest entries in a work unit handed to a pool (rounded up to whole microbatches)
MIN_REMOTE = 64  # a range this short (a tiny window's tail) costs more to ship than to map here

# (operator index in the chain, fn, drop_none): one map_transform as the workers know it
MapStage = tuple[int, Callable[[Any], Any], bool]
# what a mapper returns: payloads, their base positions, the entry of each kept record (None:
# nothing was dropped, entry = lo + i)
Fetched = tuple[list[Any], list[int], list[int] | None]


def map_stage(
    fn: Callable[[Any], Any], drop_none: bool, payloads: list[Any], keep: list[int] | None
) -> tuple[list[Any], list[int] | None]:
    """One ``map_transform`` over ``payloads``; ``keep`` maps the survivors to the input list.

    ``None`` results are found by identity only: a record's own ``==`` (a numpy array's) must
    never run here.
    """
    payloads = list(map(fn, payloads))
    if drop_none and any(map(is_, payloads, repeat(None))):
        flags = list(map(is_not, payloads, repeat(None)))
        kept = list(compress(range(len(payloads)), flags))
        payloads = list(compress(payloads, flags))
        keep = kept if keep is None else [keep[i] for i in kept]
    return payloads, keep


def apply_maps(
    stages: Sequence[MapStage], payloads: list[Any]
) -> tuple[list[Any], list[int] | None]:
    """Every stage in turn; returns the payloads and which inputs they came from (None: all)."""
    keep = None
    for _, fn, drop_none in stages:
        payloads, keep = map_stage(fn, drop_none, payloads, keep)
    return payloads, keep


def finish(lo: int, payloads: list[Any], positions: list[int], keep: list[int] | None) -> Fetched:
    if keep is None:
        return payloads, positions, None
    return payloads, [positions[i] for i in keep], [lo + i for i in keep]


class Mapper:
    """The interface lane readers use; ``unit`` and ``lookahead`` size their read-ahead."""

    unit = 1  # entries per block: 1 means one microbatch at a time
    lookahead = 1  # blocks submitted ahead of the one being read

    def submit(self, window: Window, lo: int, hi: int) -> Any:
        return (window, lo, hi)

    def result(self, handle: Any) -> Fetched:
        window, lo, hi = handle
        return window.fetch(lo, hi)

    def fetch_all(self, window: Window) -> tuple[list[Any], list[int]]:
        """Every entry of ``window`` mapped (a pack needs the whole window), in units."""
        n = window.entries()
        step = max(self.unit, 1) if self.lookahead > 1 else max(n, 1)
        handles = [self.submit(window, lo, min(lo + step, n)) for lo in range(0, n, step)]
        payloads: list[Any] = []
        positions: list[int] = []
        for handle in handles:
            p, pos, _ = self.result(handle)
            payloads += p
            positions += pos
        return payloads, positions

    def close(self) -> None:
        """Stop every worker; safe to call twice and from any thread."""


class InlineMapper(Mapper):
    """Maps on the reader's thread when a block is read: nothing runs ahead."""


class ThreadMapper(Mapper):
    """Maps on ``workers`` threads; blocks of ``UNIT`` entries, ``2 * workers`` ahead per lane."""

    unit = UNIT

    def __init__(self, workers: int) -> None:
        self.lookahead = max(2, 2 * workers)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="zephon-map")

    def submit(self, window: Window, lo: int, hi: int) -> Future:
        return self._pool.submit(window.fetch, lo, hi)

    def result(self, handle: Future) -> Fetched:
        return handle.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_mapper(ops: Sequence[Operator], spec: PrefetchSpec | None) -> Mapper:
    """The mapper for a chain and its prefetch settings.

    ``workers="processes"`` (the default) needs map functions a fresh process can load; any it
    cannot (a lambda, a nested function, one defined in an interactive session) makes the chain
    fall back to threads with a ``RuntimeWarning`` that names the function and the fix.
    """
    from zephon.pipeline.operators import MapOp

    if spec is None or spec.parallelism == 1:
        return InlineMapper()
    stages = [(i, op.fn, op.drop_none) for i, op in enumerate(ops) if isinstance(op, MapOp)]
    if not stages:
        return InlineMapper()  # nothing to run in parallel: reading and shuffling are cheap
    if spec.workers == "threads":
        return ThreadMapper(spec.parallelism)
    for _, fn, _ in stages:
        problem = _unloadable(fn)
        if problem:
            import warnings

            warnings.warn(
                f"prefetch(parallelism={spec.parallelism}): map_transform function "
                f"{_name(fn)} cannot be sent to a worker process ({problem}), so maps run on "
                "threads, which pure-Python code cannot run in parallel; define it at module "
                "level to use worker processes, or pass workers='threads' to choose threads",
                RuntimeWarning,
                stacklevel=4,
            )
            return ThreadMapper(spec.parallelism)
    return ProcessMapper(stages, spec.parallelism)


def _name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module != "builtins" else name


def _unloadable(fn: Any) -> str | None:
    """Why a spawned process could not load ``fn``, or ``None`` if it can."""
    try:
        pickle.dumps(fn, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # PicklingError, or AttributeError for local objects
        return f"{type(exc).__name__}: {exc}"
    if getattr(fn, "__module__", None) == "__main__":
        main = sys.modules.get("__main__")
        if getattr(main, "__file__", None) is None:
            return "it lives in an interactive __main__ that a new process cannot import"
    return None


# -- worker processes ----------------------------------------------------------------------------

_OK, _FAILED, _INIT = 0, 1, 2


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _serve(tasks: Any, results: Any, blob: bytes) -> None:
    """A worker process: load the map stages once, then map task after task until EOF.

    EOF on ``tasks`` also means the parent died (only the parent holds the writing end), so a
    worker never outlives a killed training process.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        stages = pickle.loads(blob)
    except BaseException as exc:
        results.send_bytes(pickle.dumps((-1, _INIT, _one_line(exc))))
        return
    while True:
        try:
            data = tasks.recv_bytes()
        except (EOFError, OSError):
            return
        task_id, ids, payloads = pickle.loads(data)
        keep = None
        stage = None
        try:
            for stage in ids:
                fn, drop_none = stages[stage]
                payloads, keep = map_stage(fn, drop_none, payloads, keep)
            stage = None
            reply = pickle.dumps((task_id, _OK, (payloads, keep)), pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:
            failure = (stage, _one_line(exc), traceback.format_exc())
            reply = pickle.dumps((task_id, _FAILED, failure), pickle.HIGHEST_PROTOCOL)
        try:
            results.send_bytes(reply)
        except OSError:
            return


class _RemoteTraceback(Exception):
    """The traceback of a map function that failed in a worker process, chained as the cause."""

    def __str__(self) -> str:
        return self.args[0]


def _feed(conn: Any, items: queue.SimpleQueue) -> None:
    """Sends tasks to one worker, so the reader never blocks on a full pipe (a worker busy with
    the previous task reads the next only when done; a blocked reader would then never read the
    result the worker is trying to send: a deadlock)."""
    while True:
        data = items.get()
        if data is None:
            return
        try:
            conn.send_bytes(data)
        except OSError:
            return


def _collect(worker: _Worker, done: dict[int, tuple[int, Any]], arrived: threading.Condition):
    """Reads one worker's answers as they come, so a worker never waits on a full pipe while
    the reader waits for another worker's unit (a unit's result is larger than a pipe holds:
    the worker would idle until its turn came)."""
    while True:
        try:
            task_id, status, body = pickle.loads(worker.results.recv_bytes())
        except (EOFError, OSError):
            with arrived:
                worker.ended = True
                arrived.notify_all()
            return
        with arrived:
            if status == _INIT:
                worker.init_error = body
            else:
                worker.outstanding -= 1
                done[task_id] = (status, body)
            arrived.notify_all()


class _Worker:
    __slots__ = (
        "process",
        "tasks",
        "results",
        "queue",
        "feeder",
        "collector",
        "outstanding",
        "ended",
        "init_error",
    )

    def __init__(
        self,
        ctx: Any,
        index: int,
        blob: bytes,
        done: dict[int, tuple[int, Any]],
        arrived: threading.Condition,
    ) -> None:
        task_r, self.tasks = ctx.Pipe(duplex=False)
        self.results, result_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_serve,
            args=(task_r, result_w, blob),
            name=f"zephon-map-{index}",
            daemon=True,
        )
        self.process.start()
        # Keep only our ends: the worker then sees EOF if we die, and we see EOF if it does.
        task_r.close()
        result_w.close()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.feeder = threading.Thread(
            target=_feed, args=(self.tasks, self.queue), name=f"zephon-map-feed-{index}"
        )
        self.feeder.daemon = True
        self.feeder.start()
        self.outstanding = 0
        self.ended = False
        self.init_error: str | None = None
        self.collector = threading.Thread(
            target=_collect, args=(self, done, arrived), name=f"zephon-map-collect-{index}"
        )
        self.collector.daemon = True
        self.collector.start()


def _terminate(workers: list[_Worker]) -> None:
    """End every worker now (a result still being computed is not needed any more)."""
    for w in workers:
        w.queue.put(None)
        if w.process.is_alive():
            w.process.terminate()
    for w in workers:
        w.process.join(5)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.feeder.join(1)
        w.collector.join(1)
        w.tasks.close()
    workers.clear()


def _start_method() -> str:
    """``forkserver`` where there is one (Linux, macOS), else ``spawn``; never ``fork``.

    A plain fork would copy this process with its threads' locks held (the prefetch thread's,
    a framework's); the fork server is a clean single-threaded process that imported
    ``__main__`` once, so forking workers from it is safe and takes milliseconds, where
    ``spawn`` starts and imports a new interpreter per worker.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # Have the fork server import this module (and so zephon) once, before its first fork,
    # instead of every worker of every iteration importing it. The list is extended, never
    # replaced; once the server runs, this changes nothing.
    from multiprocessing import forkserver

    preload = list(getattr(forkserver._forkserver, "_preload_modules", None) or ["__main__"])
    if __name__ not in preload:
        forkserver.set_forkserver_preload([*preload, __name__])
    return "forkserver"


class _Task:
    __slots__ = ("id", "worker", "window", "lo", "hi", "positions")

    def __init__(self, task_id, worker, window, lo, hi, positions) -> None:
        self.id, self.worker, self.window = task_id, worker, window
        self.lo, self.hi, self.positions = lo, hi, positions


class ProcessMapper(Mapper):
    """Maps in ``workers`` worker processes, started on the first unit worth sending.

    ``submit`` and ``result`` are called by one thread (the prefetch thread); ``close`` may be
    called from any thread, and also runs when the mapper is garbage-collected or the
    interpreter exits. Units go to the worker with the fewest outstanding; a thread per worker
    collects its answers as they come and keeps them until asked for.
    """

    unit = UNIT

    def __init__(self, stages: Sequence[MapStage], workers: int) -> None:
        self.lookahead = max(2, 2 * workers)
        self._stages = {i: (fn, drop_none) for i, fn, drop_none in stages}
        self._count = workers
        self._workers: list[_Worker] = []
        self._done: dict[int, tuple[int, Any]] = {}  # answers not yet asked for, by task id
        self._arrived = threading.Condition()
        self._next_id = 0
        self._closed = False
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _terminate, self._workers)

    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first unit and after close)."""
        return [w.process.pid for w in self._workers]

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise PipelineError("the pipeline's map workers were closed; iterate it again")
            if self._workers:
                return
            ctx = multiprocessing.get_context(_start_method())
            blob = pickle.dumps(self._stages, pickle.HIGHEST_PROTOCOL)
            for index in range(self._count):
                self._workers.append(_Worker(ctx, index, blob, self._done, self._arrived))

    def submit(self, window: Window, lo: int, hi: int) -> Any:
        if hi - lo < MIN_REMOTE:
            return (window, lo, hi)
        if not self._workers:
            self._start()
        raw, positions = window.select(lo, hi)
        task_id = self._next_id
        self._next_id += 1
        ids = tuple(i for i, _, _ in window.stages)
        try:
            data = pickle.dumps((task_id, ids, raw), pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise PipelineError(
                f"a record of lane {window.lane} cannot be sent to a map worker process "
                f"({_one_line(exc)}); make records picklable or use prefetch(..., "
                "workers='threads')"
            ) from exc
        with self._arrived:
            worker = min(self._workers, key=lambda w: w.outstanding)
            worker.outstanding += 1
        worker.queue.put(data)
        return _Task(task_id, worker, window, lo, hi, positions)

    def result(self, handle: Any) -> Fetched:
        if not isinstance(handle, _Task):
            return super().result(handle)
        worker = handle.worker
        with self._arrived:
            while handle.id not in self._done:
                if worker.init_error is not None or worker.ended:
                    break
                self._arrived.wait()
            found = self._done.pop(handle.id, None)
        if found is None:
            self._fail(worker)
        status, body = found
        if status == _FAILED:
            stage, text, remote = body
            if stage is None:
                what = "a map_transform function returned a record that cannot be pickled"
            else:
                fn = self._stages[stage][0]
                what = f"map_transform {_name(fn)} (operator {stage + 1} of the chain)"
            raise PipelineError(
                f"{what}: {text} in a map worker process, lane {handle.window.lane}; fix the "
                "function (its traceback is chained), or debug it in this process with "
                "prefetch(..., workers='threads')"
            ) from _RemoteTraceback(remote)
        payloads, keep = body
        return finish(handle.lo, payloads, handle.positions, keep)

    def _fail(self, worker: _Worker) -> None:
        """Raise what stopped ``worker`` before it answered."""
        if worker.init_error is not None:
            raise PipelineError(
                f"map functions cannot be loaded in a worker process ({worker.init_error}); "
                "define them at module level of an importable module (a script needs an `if "
                "__name__ == '__main__':` guard), or use prefetch(..., workers='threads')"
            )
        if self._closed:
            raise PipelineError("the pipeline's map workers were closed; iterate it again")
        worker.process.join(1)
        raise PipelineError(
            f"map worker process {worker.process.pid} ended unexpectedly (exit code "
            f"{worker.process.exitcode}); check its memory use, or run the maps in this "
            "process with prefetch(..., workers='threads') to see what stops it"
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._finalizer()
