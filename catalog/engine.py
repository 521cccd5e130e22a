"""Engines and transactions for the two supported backends, and the translation of driver errors.

``Database`` wraps one SQLAlchemy engine and hands out sessions in two flavours:

- ``read()``: a plain transaction.
- ``write()``: on SQLite ``BEGIN IMMEDIATE``, which takes the write lock at the start. A
  deferred transaction that reads and then writes can fail at once with "database is locked"
  when another writer committed in between (the busy timeout does not apply to that upgrade);
  taking the lock first makes writers queue behind the busy timeout instead. On PostgreSQL it is
  an ordinary READ COMMITTED transaction; guarded updates and row locks do the rest.

Both commit on success, roll back on any exception, and translate SQLAlchemy's connectivity
errors into ``CatalogUnavailableError`` with the password masked. One ``Database`` may be shared
by threads (the pool hands each session its own connection); processes must build their own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    InterfaceError,
    NoSuchModuleError,
    OperationalError,
)

from zephon.catalog.errors import CatalogDatabaseError, CatalogUnavailableError, InvalidValueError
from zephon.catalog.lookup import SQLITE_BUSY_TIMEOUT_S

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

POSTGRES_CONNECT_TIMEOUT_S = 10
_IMMEDIATE = "zephon_sqlite_immediate"


def parse_url(url: str | URL) -> URL:
    """Parse a catalog URL, refusing anything but SQLite files and PostgreSQL via psycopg."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise InvalidValueError(
            "catalog URL", mask_url(url), "expected sqlite:///PATH or postgresql+psycopg://..."
        ) from exc
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise InvalidValueError(
                "catalog URL",
                mask_url(parsed),
                "an in-memory SQLite catalog is private to one connection; use sqlite:///PATH",
            )
    elif backend == "postgresql":
        if "+" not in parsed.drivername:
            # SQLAlchemy's default PostgreSQL driver is psycopg2; Zephon depends on psycopg 3.
            parsed = parsed.set(drivername="postgresql+psycopg")
        elif parsed.get_driver_name() not in ("psycopg", "psycopg2"):
            raise InvalidValueError(
                "catalog URL",
                mask_url(parsed),
                "expected sqlite:///PATH or postgresql+psycopg://...",
            )
    else:
        raise InvalidValueError(
            "catalog URL", mask_url(parsed), "expected sqlite:///PATH or postgresql+psycopg://..."
        )
    return parsed


# Catalog URLs and driver texts carry a password as the URL's password, as a query parameter
# (?password=, ?sslpassword=) or as a libpq keyword (password=...). The catalog cannot use the
# storage layer's redaction (the layers do not import each other), so it masks these forms.
_SECRET_PARAM = r"[\w.\-]*(?:passw|pwd|secret|token|key|credential|auth)[\w.\-]*"
_QUERY_SECRET = re.compile(
    rf"(?P<lead>[?&;])(?P<name>{_SECRET_PARAM})=(?P<value>[^&;#\s'\"]*)", re.I
)
_KEYWORD_SECRET = re.compile(
    rf"(?<![\w.\-])(?P<name>{_SECRET_PARAM})(?P<sep>\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'|[^\s'\"&]+)",
    re.I,
)
_USERINFO = re.compile(r"(?P<user>//[^/@:\s'\"]*):[^\s'\"]*@")
_URL_IN_TEXT = re.compile(r"(?<![\w+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_MASK = "***"


def _mask_query(text: str) -> str:
    return _QUERY_SECRET.sub(
        lambda m: m[0] if m["value"] in ("", _MASK) else f"{m['lead']}{m['name']}={_MASK}", text
    )


def mask_url(url: str | URL) -> str:
    """The URL as text with any password (user:password@, ?password=...) replaced by ``***``;
    safe for messages and logs."""
    try:
        rendered = make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        # Unparseable, so mask a "user:password@" part textually.
        rendered = _USERINFO.sub(lambda m: f"{m['user']}:{_MASK}@", str(url))
    return _mask_query(rendered)


def url_secrets(url: str | URL) -> frozenset[str]:
    """The password and secret query values of a catalog URL, to scrub from driver texts."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return frozenset()
    values = [parsed.password] + [
        value
        for name, value in parsed.query.items()
        if re.fullmatch(_SECRET_PARAM, name, re.I) and isinstance(value, str)
    ]
    return frozenset(str(v) for v in values if v)


def redact_text(text: str, secrets: frozenset[str] = frozenset()) -> str:
    """A driver's message with the known ``secrets``, URL passwords and ``password=...``
    keywords masked (libpq quotes parts of the connection string in some errors)."""
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 4:  # shorter ones would garble words; the patterns below catch them
            text = text.replace(secret, _MASK)
    text = _URL_IN_TEXT.sub(lambda m: mask_url(m[0]), text)
    return _KEYWORD_SECRET.sub(
        lambda m: m[0] if m["value"] in (_MASK, f"'{_MASK}'") else f"{m['name']}{m['sep']}{_MASK}",
        text,
    )


def _use_wal(cursor: Any) -> None:
    """Switch a SQLite connection to WAL. The switch needs an exclusive lock, and SQLite
    answers "database is locked" at once, without waiting in its busy handler, while another
    connection holds one: as when several processes open a new catalog at the same moment.
    Try again until the busy timeout, as every other statement waits."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    delay = 0.01
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def read_only_url(url: URL) -> URL:
    """The SQLite URL that opens the same file read-only (``mode=ro``): SQLite itself refuses
    every write, and a missing file is an error instead of a new, empty database."""
    database = url.database or ""
    if database.startswith("file:"):
        path, _, query = database[len("file:") :].partition("?")
        extra = "&".join(part for part in query.split("&") if part and not part.startswith("mode="))
        database = f"file:{path}?mode=ro" + (f"&{extra}" if extra else "")
    else:
        database = f"file:{urllib.parse.quote(os.path.abspath(database))}?mode=ro"
    return url.set(database=database, query={**url.query, "uri": "true"})


def _sqlite_engine(url: URL, *, read_only: bool = False) -> Engine:
    if read_only:
        url = read_only_url(url)
    elif url.database and not url.database.startswith("file:"):
        directory = os.path.dirname(os.path.abspath(url.database))
        # The default catalog lives in the user's data directory, which may not exist yet.
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise CatalogUnavailableError(
                mask_url(url),
                f"cannot create the directory {directory} ({reason})",
                "point the URL (--catalog or ZEPHON_CATALOG_URL) at a directory you can write",
            ) from exc
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take BEGIN away from the sqlite3 module (it skips it for SELECT and DDL), so that
        # _on_begin below decides which kind of transaction each session gets.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_S * 1000}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if read_only:
                return  # the journal mode is the writers' to set; a reader must not try
            # WAL lets readers (resuming jobs, `zephon runs`) proceed while gc writes.
            _use_wal(cursor)
            # NORMAL is crash-safe in WAL mode; a power cut may lose the last commits, which
            # the marker probe and `zephon sync` repair from storage (the source of truth).
            cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        if connection.get_execution_options().get(_IMMEDIATE):
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            connection.exec_driver_sql("BEGIN")

    return engine


def _postgres_engine(url: URL, *, read_only: bool = False) -> Engine:
    connect_args: dict[str, Any] = {
        "connect_timeout": POSTGRES_CONNECT_TIMEOUT_S,
        "application_name": "zephon-catalog",
    }
    if read_only:
        # every transaction of these sessions is READ ONLY: the server refuses any write
        connect_args["options"] = "-c default_transaction_read_only=on"
    return create_engine(
        url,
        # A pooled connection may have been closed by the server or a proxy since its last use.
        pool_pre_ping=True,
        connect_args=connect_args,
    )


def make_engine(url: str | URL, *, read_only: bool = False) -> Engine:
    """A configured engine for a catalog URL (SQLite pragmas, or PostgreSQL pre-ping);
    ``read_only``: the database refuses writes (SQLite ``mode=ro``, PostgreSQL read-only
    transactions)."""
    parsed = parse_url(url)
    try:
        if parsed.get_backend_name() == "sqlite":
            return _sqlite_engine(parsed, read_only=read_only)
        return _postgres_engine(parsed, read_only=read_only)
    except NoSuchModuleError as exc:
        raise CatalogUnavailableError(
            mask_url(parsed), f"no driver for {parsed.drivername} (pip install 'zephon[postgres]')"
        ) from exc
    except ModuleNotFoundError as exc:
        raise CatalogUnavailableError(
            mask_url(parsed), f"{exc} (pip install 'zephon[postgres]')"
        ) from exc


def driver_reason(exc: DBAPIError, secrets: frozenset[str] = frozenset()) -> str:
    """The first line of the driver's message, credentials masked: enough for a one-line CLI
    error."""
    original = exc.orig if exc.orig is not None else exc
    lines = [line.strip() for line in str(original).splitlines() if line.strip()]
    return redact_text(lines[0], secrets) if lines else type(original).__name__


_SQLITE_FIX = (
    "check that the URL (--catalog or ZEPHON_CATALOG_URL) names a SQLite file you can read "
    "and write"
)
_SQLITE_WRITABLE_FIX = (
    "writable or point the URL (--catalog or ZEPHON_CATALOG_URL) at a file in a "
    "writable directory (SQLite writes -wal and -shm files beside the database, even to read)"
)
_SQLITE_FULL_FIX = (
    "free space on that disk or point the URL (--catalog or ZEPHON_CATALOG_URL) at a file on "
    "a larger disk"
)
#: SQLite result codes (extended ones start with these) that a path one cannot write gives
_SQLITE_WRITE_REFUSED = ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_IOERR", "SQLITE_PERM")


def _nearly_full(directory: str) -> bool:
    """Whether the disk holding ``directory`` has less than a SQLite page cache's worth free."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < 1 << 20


def _sqlite_unavailable(url: str, exc: DBAPIError, reason: str) -> CatalogUnavailableError:
    """A SQLite failure said as what it is: a full disk, a read-only file or directory (which
    SQLite reports as "unable to open database file" or "attempt to write a readonly
    database"), else the driver's reason with a fix about the file, not a server."""
    code = str(getattr(exc.orig, "sqlite_errorname", "") or "")
    database = make_url(url).database or ""
    path = os.path.abspath(database) if database and not database.startswith("file:") else ""
    if (
        code.startswith("SQLITE_FULL")
        or getattr(exc.orig, "errno", None) == errno.ENOSPC
        # a write that met ENOSPC in the WAL or its index may come back as an I/O error
        or (path and code.startswith("SQLITE_IOERR") and _nearly_full(os.path.dirname(path)))
    ):
        where = f"the disk holding {path}" if path else "the disk"
        return CatalogUnavailableError(url, f"{where} is full ({reason})", _SQLITE_FULL_FIX)
    if path and code.startswith(_SQLITE_WRITE_REFUSED):
        directory = os.path.dirname(path)
        # access() also answers EROFS for a read-only mount, where root's writes fail too.
        refused = [
            f"the {kind} {where}"
            for kind, where, there in (
                ("directory", directory, os.path.isdir(directory)),
                ("file", path, os.path.exists(path)),
            )
            if there and not os.access(where, os.W_OK)
        ]
        if refused:
            are, them = ("are", "them") if len(refused) > 1 else ("is", "it")
            return CatalogUnavailableError(
                url,
                f"{' and '.join(refused)} {are} read-only ({reason})",
                f"make {them} {_SQLITE_WRITABLE_FIX}",
            )
    return CatalogUnavailableError(url, reason, _SQLITE_FIX)


@contextlib.contextmanager
def translate_errors(
    url: str, action: str, secrets: frozenset[str] = frozenset()
) -> Iterator[None]:
    """Turn SQLAlchemy errors raised inside the block into catalog errors naming ``url``
    (masked here too, whatever the caller passed). On SQLite a connection-level failure is
    about the file: its message says so (read-only, disk full) and never asks for a server."""
    url = mask_url(url)
    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        reason = driver_reason(exc, secrets)
        if url.startswith("sqlite"):
            raise _sqlite_unavailable(url, exc, reason) from exc
        raise CatalogUnavailableError(url, reason) from exc
    except DBAPIError as exc:
        raise CatalogDatabaseError(url, action, driver_reason(exc, secrets)) from exc


class Database:
    """One engine plus the session factories the catalog uses; see the module docstring."""

    def __init__(self, url: str | URL, *, read_only: bool = False) -> None:
        # here, not at the top: make_engine and translate_errors serve Core readers too
        # (catalog.lookup), which must not load the ORM
        from sqlalchemy.orm import sessionmaker

        self.engine = make_engine(url, read_only=read_only)
        self.read_only = read_only
        # the URL as the caller gave it (masked), not the read-only URI built from it
        self.url = mask_url(parse_url(url) if read_only else self.engine.url)
        self._secrets = url_secrets(self.engine.url)
        self.dialect = self.engine.dialect.name
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        self._writer = sessionmaker(
            self.engine.execution_options(**{_IMMEDIATE: True}), expire_on_commit=False
        )

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    @contextlib.contextmanager
    def read(self, action: str) -> Iterator[Session]:
        """A session for queries; ``action`` names the operation in error messages."""
        with translate_errors(self.url, action, self._secrets), self._reader.begin() as session:
            yield session

    @contextlib.contextmanager
    def write(self, action: str) -> Iterator[Session]:
        """A session for changes, committed on success (``BEGIN IMMEDIATE`` on SQLite)."""
        with translate_errors(self.url, action, self._secrets), self._writer.begin() as session:
            yield session

    @contextlib.contextmanager
    def immediate_connection(self, action: str) -> Iterator[Any]:
        """A Core connection inside one write transaction (schema creation and upgrade)."""
        with translate_errors(self.url, action, self._secrets), self.engine.connect() as connection:
            connection.execution_options(**{_IMMEDIATE: True})
            with connection.begin():
                yield connection

    def dispose(self) -> None:
        self.engine.dispose()
