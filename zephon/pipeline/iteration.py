"""Iterating a pipeline: the group's batches in turn order, optionally prefetched.

The batches come from one deterministic generator (``_produce``); prefetching runs that same
generator in a background thread behind a bounded queue, and map parallelism hands its maps to
a mapper (``parallel.py``: threads or worker processes), so both change when and where work
happens and never what is produced.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from zephon.pipeline.errors import PipelineError
from zephon.pipeline.lanes import LanePlan, LaneProgress, LaneReader, next_lane
from zephon.pipeline.operators import BatchSpec
from zephon.pipeline.parallel import make_mapper
from zephon.pipeline.records import Batch

if TYPE_CHECKING:
    from zephon.pipeline.pipeline import Pipeline

__all__ = ["Iteration"]

_END = object()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _produce(
    readers: dict[int, LaneReader], spec: BatchSpec
) -> Iterator[tuple[Batch, int, LaneProgress]]:
    """The group's batches in delivery order: each from the owned lane whose turn it is."""
    active = sorted(readers)
    size, drop_last = spec.microbatch_size, spec.drop_last
    while active:
        lane = next_lane(active, readers)
        result = readers[lane].next_batch(size, drop_last)
        if result is None:
            active.remove(lane)
            continue
        batch, progress = result
        yield batch, lane, progress


def _fill(items: Iterator, out: queue.Queue, stop: threading.Event) -> None:
    """Prefetch thread body. It holds no reference to the iterator object, so an iterator the
    caller drops is collected and its ``__del__`` stops this thread."""

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in items:
            if not put(item):
                return
        put(_END)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        put(_Failure(exc))


class Iteration:
    """One pass of ``iter(pipeline)``: lane readers, the turn order, maybe a prefetch thread.

    Delivery (``Pipeline._deliver``) happens in ``__next__``, on the caller's thread, when a
    batch is handed over; the prefetch thread only ever prepares.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        plan: LanePlan,
        owned: list[int],
        progress: dict[int, LaneProgress],
    ) -> None:
        self._pipeline = pipeline
        spec = pipeline._prefetch
        self._mapper = make_mapper(plan.ops, spec)
        readers = {lane: LaneReader(plan, lane, progress[lane], self._mapper) for lane in owned}
        self._closed = False
        self._stop = threading.Event()
        self._gen = _produce(readers, pipeline._batch)
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if spec is not None:
            self._queue = queue.Queue(maxsize=spec.buffer_size)
            self._thread = threading.Thread(
                target=_fill,
                args=(self._gen, self._queue, self._stop),
                name="zephon-pipeline-prefetch",
                daemon=True,
            )
            self._thread.start()

    def __iter__(self) -> Iteration:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            if self._pipeline._active is not self:
                raise PipelineError(
                    "this iterator was ended by restore() or a newer iter(pipeline); iterate "
                    "the pipeline again"
                )
            raise StopIteration
        item = next(self._gen, _END) if self._queue is None else self._queue.get()
        if item is _END:
            self._finish()
            raise StopIteration
        if isinstance(item, _Failure):
            self._finish()
            raise item.exc
        batch, lane, progress = item
        self._pipeline._deliver(lane, progress)
        return batch

    def _finish(self) -> None:
        self._closed = True
        self._stop.set()
        self._mapper.close()  # worker processes end here, not when the thread notices

    def close(self) -> None:
        self._finish()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._mapper.close()
