"""Metrics for scrapers (docs/goodput.md, "Metrics"): a job's save and load durations, bytes,
stall, the local tier's upload lag, its save period and the run's goodput, in Prometheus'
format, over HTTP (``prometheus_port``) or in a file node_exporter's textfile collector reads
(``textfile``).

``prometheus-client`` is an optional extra (``pip install 'zephon[prometheus]'``): it is
imported when a job configures metrics, never by Zephon otherwise. Every metric lives in a
registry of the job's own, labelled with the run's name, so two jobs in one process (tests,
notebooks) never clash.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zephon.errors import ConfigError, invalid_option

__all__ = ["EXTRA_HINT", "Metrics", "MetricsConfig"]

#: what a job without the extra is told to install
EXTRA_HINT = "pip install 'zephon[prometheus]'"
_KEYS = ("prometheus_port", "textfile")
#: the durations the histograms count in (seconds)
_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(
            f"metrics need the prometheus-client package, which is not installed: {EXTRA_HINT}"
        ) from None
    return prometheus_client


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """``metrics``: ``prometheus_port`` (an HTTP endpoint on this port of rank 0; 0 picks a
    free one; None: none) and ``textfile`` (a file rewritten after each save and load; None:
    none). Checking it needs the extra: a job that asks for metrics without it fails at once."""

    prometheus_port: int | None = None
    textfile: str | None = None

    @classmethod
    def checked(cls, value: Any, key: str) -> MetricsConfig | None:
        """A ``MetricsConfig`` from itself or a mapping of its fields, None for None;
        ``ConfigError`` naming ``key`` and the fix for anything else, or without the extra."""
        if value is None:
            return None
        if isinstance(value, MetricsConfig):
            value = {"prometheus_port": value.prometheus_port, "textfile": value.textfile}
        if not isinstance(value, Mapping):
            raise invalid_option(key, value, "use a mapping of prometheus_port, textfile")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ConfigError(
                f"{key}.{unknown[0]} is not a known setting; known: {', '.join(_KEYS)}"
            )
        port, textfile = value.get("prometheus_port"), value.get("textfile")
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
        ):
            raise invalid_option(
                f"{key}.prometheus_port", port, "use a port from 0 (any free one) to 65535"
            )
        if textfile is not None and (
            not isinstance(textfile, str | os.PathLike) or not os.fspath(textfile).strip()
        ):
            raise invalid_option(f"{key}.textfile", textfile, "use a file path, e.g. zephon.prom")
        if port is None and textfile is None:
            raise ConfigError(
                f"{key} names no output: set {key}.prometheus_port (0: any free port) or "
                f"{key}.textfile, or leave {key} unset"
            )
        _client()
        return cls(port, None if textfile is None else os.fspath(textfile))


class Metrics:
    """One job's metrics (rank 0): observe saves and loads, serve them and write them.

    ``backlog`` returns the destination's ``(pending uploads, oldest age s)``; ``goodput``
    the run's goodput ratio or None (no catalog): both are read at each scrape and each
    textfile write."""

    def __init__(
        self,
        config: MetricsConfig,
        run: str,
        *,
        backlog: Callable[[], tuple[int, float]] = lambda: (0, 0.0),
        goodput: Callable[[], float | None] = lambda: None,
    ) -> None:
        client = _client()
        self.config = config
        self.registry = client.CollectorRegistry(auto_describe=True)
        labels, values = ["run"], [run]

        def histogram(name: str, text: str) -> Any:
            metric = client.Histogram(name, text, labels, registry=self.registry, buckets=_BUCKETS)
            return metric.labels(*values)

        def counter(name: str, text: str) -> Any:
            return client.Counter(name, text, labels, registry=self.registry).labels(*values)

        def gauge(name: str, text: str) -> Any:
            return client.Gauge(name, text, labels, registry=self.registry).labels(*values)

        self._save_s = histogram("zephon_save_seconds", "Duration of a save, begin to commit")
        self._stall_s = histogram("zephon_save_stall_seconds", "Time a save blocked training")
        self._load_s = histogram("zephon_load_seconds", "Duration of a load (resume)")
        self._save_bytes = counter("zephon_saved_bytes", "Bytes of committed checkpoints")
        self._load_bytes = counter("zephon_loaded_bytes", "Bytes of checkpoints loaded")
        self._last_step = gauge("zephon_last_saved_step", "Step of the newest save")
        self._period = gauge("zephon_save_period_steps", "Current save period in steps")
        pending = gauge("zephon_uploads_pending", "Local-tier copies not yet on save_dir")
        oldest = gauge("zephon_upload_oldest_age_seconds", "Age of the oldest pending upload")
        ratio = gauge("zephon_goodput_ratio", "Productive share of the run's wall time")
        pending.set_function(lambda: float(backlog()[0]))
        oldest.set_function(lambda: float(backlog()[1]))
        ratio.set_function(lambda: float("nan") if (g := goodput()) is None else g)
        self._server: Any = None
        self.port: int | None = None
        if config.prometheus_port is not None:
            server, _thread = client.start_http_server(
                config.prometheus_port, registry=self.registry
            )
            self._server, self.port = server, server.server_port

    def committed(self, step: int, seconds: float, size: int | None) -> None:
        """A save of ``step`` committed ``seconds`` after it began (an async save: in the
        background), ``size`` bytes."""
        self._save_s.observe(max(0.0, seconds))
        if size:
            self._save_bytes.inc(size)
        self._last_step.set(step)

    def stalled(self, stall_s: float) -> None:
        """A save returned to training after blocking it ``stall_s`` seconds."""
        self._stall_s.observe(max(0.0, stall_s))
        self.write()

    def loaded(self, seconds: float, size: int | None) -> None:
        self._load_s.observe(max(0.0, seconds))
        if size:
            self._load_bytes.inc(size)
        self.write()

    def period(self, steps: int) -> None:
        self._period.set(steps)

    def write(self) -> None:
        """Rewrite the textfile, if configured (atomically: a scraper never reads half)."""
        if self.config.textfile is not None:
            _client().write_to_textfile(self.config.textfile, self.registry)

    def text(self) -> str:
        """The metrics in Prometheus' text format (what a scrape returns)."""
        return _client().generate_latest(self.registry).decode()

    def close(self) -> None:
        """Write the textfile a last time and stop the HTTP endpoint."""
        with contextlib.suppress(Exception):
            self.write()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
