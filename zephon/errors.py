"""The zephon layer's exception root and the errors shared across its modules."""

from __future__ import annotations

from zephon import catalog as catalog_layer
from zephon import storage


class ZephonError(Exception):
    """Root of every error the zephon layer raises on purpose."""


class ConfigError(ZephonError, ValueError):
    """An invalid configuration value; the message names the key, the value and what is allowed."""


def invalid_option(key: str, value: object, allowed: str) -> ConfigError:
    """The one-line ``ConfigError`` for option ``key``: its value (secrets redacted) and what
    is allowed instead."""
    from zephon.storage import redact  # the storage layer is below; imported when a message is made

    return ConfigError(f"{key} = {redact(repr(value))} is invalid: {allowed}")


class StaleAttemptError(ZephonError):
    """A newer attempt (job start) of the run took over; this process must stop saving.

    Raised by every fenced step of the save path (catalog transitions, storage begin and the
    re-check before the marker, retention): ``as_zephon_error`` makes it of the layers'
    ``storage.FencedOutError`` and ``catalog.FencedOutError``. ``current`` describes the
    attempt that holds the run now, when known.
    """

    def __init__(self, message: str, *, current: object | None = None) -> None:
        super().__init__(message)
        self.current = current


def as_zephon_error(
    exc: BaseException, *, where: str | None = None, local_failure: BaseException | None = None
) -> BaseException:
    """The error a Zephon caller sees for ``exc``: the one home of that translation.

    A stale attempt refused by either layer (``storage.FencedOutError``,
    ``catalog.FencedOutError``) becomes ``zephon.StaleAttemptError``, caused by it. A failed
    DCP call (torch's ``CheckpointException``) on ``where`` (a checkpoint URL) becomes the
    error that caused it: ``local_failure``, this rank's own original exception if one was
    kept, wins; otherwise the lowest rank's Zephon, storage or catalog error, translated the
    same way; any other failure one ``DistributedCheckpointError`` naming every failing rank.
    Any other exception is returned unchanged.
    """
    if _is_dcp_failure(exc):
        return _dcp_cause(exc, where or "a checkpoint", local_failure)
    if isinstance(exc, storage.FencedOutError | catalog_layer.FencedOutError):
        translated = StaleAttemptError(str(exc), current=exc.current)
        translated.__cause__ = exc
        return translated
    return exc


def _is_dcp_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is torch DCP's ``CheckpointException`` (told without importing torch,
    which ``import zephon`` does not need)."""
    return type(exc).__name__ == "CheckpointException" and isinstance(
        getattr(exc, "failures", None), dict
    )


def _dcp_cause(
    exc: BaseException, where: str, local_failure: BaseException | None
) -> BaseException:
    if local_failure is not None:
        return as_zephon_error(local_failure)
    failures = {rank: pair[0] for rank, pair in sorted(exc.failures.items())}  # type: ignore[attr-defined]
    for rank, failure in failures.items():
        if isinstance(failure, ZephonError | storage.StorageError | catalog_layer.CatalogError):
            cause = as_zephon_error(failure)
            cause.add_note(f"(raised on rank {rank} of the DCP call on {where})")
            return cause
    from zephon.dcp.errors import DistributedCheckpointError  # no torch: only its errors

    lines = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in failures.items())
    step = exc.args[0] if exc.args else "checkpoint"
    return DistributedCheckpointError(
        f"DCP {step} step on {where} failed: {lines}; nothing was committed by this call: fix "
        "the cause on the ranks named and try again",
        failures=failures,
    )


class UsageError(ZephonError, ValueError):
    """A Zephon API was given a value it cannot take: the message names the argument, the
    value and what is allowed (a ``ValueError``, as such mistakes are elsewhere)."""


class ArgumentTypeError(ZephonError, TypeError):
    """A Zephon API was given an object of a kind it cannot take: the message names it and
    what is needed (a ``TypeError``, as such mistakes are elsewhere)."""


class NotCommittedError(ZephonError, RuntimeError):
    """A save was recorded or closed before ``writer.commit()`` created its marker: call it
    once every file is written (a ``RuntimeError``: the calls came in the wrong order)."""


class CopyUnavailableError(ZephonError):
    """A resume could not bring the files its ranks read of a fast tier's copy to where they
    load it (a peer holding a memory copy went away): the copy is not damaged, only out of
    reach, and the next tier is loaded instead. Raised on every rank alike."""


class SaveBelowLatestError(ZephonError):
    """A job that did not say where it resumes tried to save a step below the run's latest
    complete checkpoint: it restarted from scratch by mistake (a resume that found nothing it
    recognised) and would mix a second history into the run. ``run``, ``step`` and ``latest``
    name it; the fix is to resume from the latest checkpoint or to declare the resume step."""

    def __init__(self, message: str, *, run: str, step: int, latest: int) -> None:
        super().__init__(message)
        self.run = run
        self.step = step
        self.latest = latest

    def __reduce__(self):  # DCP sends the coordinator's error to every rank pickled
        return _rebuild_below_latest, (str(self), self.run, self.step, self.latest)


def _rebuild_below_latest(message: str, run: str, step: int, latest: int) -> SaveBelowLatestError:
    return SaveBelowLatestError(message, run=run, step=step, latest=latest)


class CatalogOutageError(ZephonError):
    """The catalog has been unreachable for longer than ``catalog_outage_s``: a job saves to
    storage through a shorter outage, and fails with this one past it. ``url`` is the
    catalog's (password masked), ``elapsed`` the outage so far in seconds."""

    def __init__(self, url: str, *, elapsed: float, deadline_s: float, reason: str) -> None:
        super().__init__(
            f"catalog {url} has been unavailable for {elapsed:.0f}s, longer than "
            f"catalog_outage_s = {deadline_s:g}s ({reason}); bring the database back (then "
            "`zephon sync` records what was saved meanwhile) or raise "
            "trainer.checkpointing.catalog_outage_s"
        )
        self.url = url
        self.elapsed = elapsed
        self.deadline_s = deadline_s
        self.reason = reason

    def __reduce__(self):  # a rank's error is sent to the others: rebuilt from its data
        return (
            _outage_error,
            (self.url, self.elapsed, self.deadline_s, self.reason),
        )


def _outage_error(url: str, elapsed: float, deadline_s: float, reason: str) -> CatalogOutageError:
    return CatalogOutageError(url, elapsed=elapsed, deadline_s=deadline_s, reason=reason)
