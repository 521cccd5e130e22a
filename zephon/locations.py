"""Where things are: the catalog URL a command uses, storage options from the environment, and
the storage location of a catalog run.

A training run's checkpoints live at ``<storage_url>/<name>/save-<step>``; an inference run's
at ``<storage_url>/save-<step>`` (the catalog still needs a name for it: by default the last
component of its ``save_dir``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zephon.errors import ConfigError
from zephon.storage import DEFAULT_RETRY, RetryPolicy, mask_url, secrets_in, validate_run

if TYPE_CHECKING:
    from zephon.catalog import RunRecord
    from zephon.storage import CheckpointStore, RunStore

__all__ = [
    "CATALOG_URL_ENV",
    "RETRY_ENV",
    "STORAGE_OPTIONS_ENV",
    "RunLocation",
    "default_catalog_url",
    "inference_run_name",
    "known_secrets",
    "resolve_catalog_url",
    "retry_from_env",
    "run_location",
    "stock_dcp_url",
    "storage_options_from_env",
]

CATALOG_URL_ENV = "ZEPHON_CATALOG_URL"
STORAGE_OPTIONS_ENV = "ZEPHON_STORAGE_OPTIONS"
RETRY_ENV = "ZEPHON_RETRY"


def default_catalog_url() -> str:
    """A SQLite file in the user's data directory (``~/.local/share/zephon`` on Linux)."""
    import platformdirs

    directory = platformdirs.user_data_dir("zephon", appauthor=False)
    os.makedirs(directory, exist_ok=True)
    return f"sqlite:///{os.path.join(directory, 'catalog.db')}"


def resolve_catalog_url(explicit: str | None = None) -> str:
    """``explicit`` (``--catalog``), else ``$ZEPHON_CATALOG_URL``, else the default SQLite file."""
    return explicit or os.environ.get(CATALOG_URL_ENV) or default_catalog_url()


def storage_options_from_env(explicit: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """fsspec storage options: ``explicit`` (a dict, or JSON text from ``--storage-options``),
    else JSON in ``$ZEPHON_STORAGE_OPTIONS``, else none (fsspec's own ``FSSPEC_<PROTOCOL>``
    environment configuration still applies)."""
    if isinstance(explicit, Mapping):
        return dict(explicit)
    text = explicit if explicit is not None else os.environ.get(STORAGE_OPTIONS_ENV)
    if not text:
        return {}
    source = "--storage-options" if explicit is not None else f"${STORAGE_OPTIONS_ENV}"
    options = _json_value(
        text, source, '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}'
    )
    if not isinstance(options, dict):
        # not the text itself: a list or string of credentials has no key names to mask by
        raise ConfigError(
            f"{source} must be a JSON object of fsspec options, got a JSON "
            f"{type(options).__name__}; give an object such as "
            '{"anon": true} or {"profile": "default"}'
        )
    return options


def retry_from_env() -> RetryPolicy:
    """The retry policy of the stores a command opens: JSON in ``$ZEPHON_RETRY`` (fields of
    ``storage.RetryPolicy``, e.g. ``{"deadline_s": 30}``), else the default."""
    text = os.environ.get(RETRY_ENV)
    if not text:
        return DEFAULT_RETRY
    from zephon.config import retry_policy_from

    value = _json_value(text, f"${RETRY_ENV}", '{"max_attempts": 10, "deadline_s": 60}')
    return retry_policy_from(value, f"${RETRY_ENV}")


def _json_value(text: str, source: str, example: str) -> Any:
    """The JSON value a user gave in ``source`` (a flag or an environment variable); invalid
    JSON is a ``ConfigError`` naming ``source`` and an ``example`` object. The text itself is
    never echoed: it may hold credentials."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{source} is not valid JSON ({exc.msg} at character {exc.pos}); give an object "
            f"such as {example}"
        ) from None


def known_secrets(argv: Sequence[str] = ()) -> frozenset[str]:
    """Credential values the user gave a command: in its arguments (URL passwords and secret
    query values, ``--storage-options`` JSON, ``name=value`` pairs) and in
    ``$ZEPHON_STORAGE_OPTIONS`` and ``$ZEPHON_CATALOG_URL``; for scrubbing from what it prints."""
    texts = list(argv)
    texts += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--") and "=" in arg]
    texts += [os.environ.get(STORAGE_OPTIONS_ENV, ""), os.environ.get(CATALOG_URL_ENV, "")]
    found: set[str] = set()
    for text in texts:
        if text:
            found |= secrets_in(text)
    return frozenset(found)


def inference_run_name(save_dir: str) -> str:
    """The catalog name of an inference job saving to ``save_dir``: its last path component."""
    name = save_dir.rstrip("/").rsplit("/", 1)[-1].split("://")[-1]
    try:
        validate_run(name)
    except ValueError:
        raise ConfigError(
            f"cannot derive a catalog run name for the inference save_dir {mask_url(save_dir)!r}: "
            "its last component is not a valid run name; pass run_name explicitly"
        ) from None
    return name


class RunLocation:
    """A catalog run and where its checkpoints are: ``storage_run`` is None for inference.

    ``RunLocation(name, store, storage_run)`` holds an open store. One made by
    ``run_location(..., deferred=True)`` opens its store when ``store`` is first read: an
    answer the catalog gives alone (``zephon latest``) then never opens the storage backend,
    nor imports its filesystem package. Immutable; may be shared by threads.
    """

    __slots__ = ("name", "storage_run", "_store", "_open", "_lock")

    name: str
    storage_run: str | None

    def __init__(self, name: str, store: CheckpointStore, storage_run: str | None) -> None:
        self._init(name, storage_run, store, None)

    @classmethod
    def deferred(
        cls, name: str, open_store: Callable[[], CheckpointStore], storage_run: str | None
    ) -> RunLocation:
        """A location whose store ``open_store()`` opens on first use (its errors then)."""
        location = cls.__new__(cls)
        location._init(name, storage_run, None, open_store)
        return location

    def _init(
        self,
        name: str,
        storage_run: str | None,
        store: CheckpointStore | None,
        open_store: Callable[[], CheckpointStore] | None,
    ) -> None:
        for attribute, value in (
            ("name", name),
            ("storage_run", storage_run),
            ("_store", store),
            ("_open", open_store),
            ("_lock", threading.Lock() if store is None else None),
        ):
            object.__setattr__(self, attribute, value)

    def __setattr__(self, attribute: str, value: object) -> None:
        raise AttributeError(f"RunLocation is immutable: cannot set {attribute!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RunLocation):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def _identity(self) -> tuple[object, ...]:
        return (self.name, self.storage_run, id(self._open or self._store))

    def __repr__(self) -> str:
        # the store's repr masks credentials; a deferred store is not opened to show it
        store = "(opened on first use)" if self._store is None else repr(self._store)
        return f"RunLocation(name={self.name!r}, store={store}, storage_run={self.storage_run!r})"

    @property
    def store(self) -> CheckpointStore:
        """The run's ``CheckpointStore`` (opened now if the location was made deferred)."""
        store = self._store
        if store is None:
            assert self._open is not None and self._lock is not None
            with self._lock:
                if self._store is None:
                    object.__setattr__(self, "_store", self._open())
                store = self._store
        return store

    @property
    def runstore(self) -> RunStore:
        """The run's handle on its store (``CheckpointStore.run``): every per-run storage
        operation of Zephon goes through it."""
        return self.store.run(self.storage_run)

    def checkpoint_url(self, step: int) -> str:
        return self.runstore.checkpoint_url(step)


def run_location(
    record: RunRecord,
    storage_options: Mapping[str, Any] | None,
    retry: RetryPolicy | None = None,
    *,
    deferred: bool = False,
) -> RunLocation:
    """Open the store of a catalog run; with ``deferred``, when the location's ``store`` is
    first read (``RunLocation.deferred``)."""
    storage_run = record.name if record.kind == "train" else None
    url = record.storage_url

    def open_store() -> CheckpointStore:
        from zephon.storage import CheckpointStore  # loads fsspec and the backends

        return CheckpointStore(url, storage_options, retry=retry)

    if deferred:
        return RunLocation.deferred(record.name, open_store, storage_run)
    return RunLocation(record.name, open_store(), storage_run)


def stock_dcp_url(
    checkpoint_url: str, payload: str, metadata: Mapping[str, Any] | None
) -> str | None:
    """The directory to point torch's stock DCP readers (``FileSystemReader``,
    ``FsspecReader``) at for a committed checkpoint: its payload directory (``payload`` from
    the marker, ``""`` before fencing) plus the DCP subdirectory holding torch's ``.metadata``
    (the marker's ``dcp.stock_metadata``). None for a checkpoint without one (no DCP state, or
    saved before Zephon wrote it)."""
    facts = (metadata or {}).get("dcp")
    name = facts.get("stock_metadata") if isinstance(facts, Mapping) else None
    if not isinstance(name, str) or not name.endswith(".metadata"):
        return None
    parts = [checkpoint_url.rstrip("/"), payload.strip("/"), name.rpartition("/")[0]]
    return "/".join(p for p in parts if p)
