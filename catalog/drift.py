"""Schema drift: reading what a database's catalog tables look like, and saying how that
differs from what a revision should have. Mechanism only; ``catalog.schema`` decides what to do.

Two comparisons, a cheap one and a thorough one:

- A ``Fingerprint`` (tables, their columns, their explicit indexes) is read with one query on
  the backend's system catalog and compared with a set operation. ``Catalog(url)`` does this on
  every open (about a millisecond on both backends), so a column dropped by hand is
  reported when the catalog is opened, not as a failed statement in the middle of a save.
- ``model_differences`` runs Alembic's ``compare_metadata`` against the ORM models: types,
  nullability, unique constraints and foreign keys as well. It reflects every table (about
  150 ms on PostgreSQL, 15 ms on SQLite), so only ``zephon db current`` and ``zephon db upgrade``
  use it.

Only the catalog's own tables are compared; unrelated tables in the same database are ignored,
and so are indexes someone added (harmless). Indexes that back a constraint (primary keys,
unique constraints) are left out of fingerprints, because SQLite names them itself
(``sqlite_autoindex_*``); those are the thorough comparison's business.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Index, bindparam, text
from sqlalchemy.schema import CreateIndex

from zephon.catalog.models import CATALOG_TABLES, Base
from zephon.catalog.revision import VERSION_TABLE


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The catalog tables present, each with its column names and explicit index names."""

    columns: Mapping[str, frozenset[str]] = field(default_factory=dict)
    indexes: Mapping[str, frozenset[str]] = field(default_factory=dict)

    @property
    def tables(self) -> tuple[str, ...]:
        return tuple(name for name in CATALOG_TABLES if name in self.columns)

    def differences(self, expected: Fingerprint) -> list[str]:
        """How these tables differ from ``expected``, one phrase each; indexes beyond the
        expected ones are not a difference."""
        found = []
        for table in CATALOG_TABLES:
            want, have = expected.columns.get(table), self.columns.get(table)
            if want is None and have is None:
                continue
            if want is None:
                found.append(f"unexpected table {table}")
                continue
            if have is None:
                found.append(f"missing table {table}")
                continue
            found += [f"missing column {table}.{c}" for c in sorted(want - have)]
            found += [f"unexpected column {table}.{c}" for c in sorted(have - want)]
            missing = expected.indexes.get(table, frozenset()) - self.indexes.get(table, set())
            found += [f"missing index {name} on {table}" for name in sorted(missing)]
        return found

    def same_indexes(self, expected: Fingerprint) -> bool:
        return all(
            self.indexes.get(t, frozenset()) == expected.indexes.get(t, frozenset())
            for t in CATALOG_TABLES
        )


def _fingerprint(rows: Iterable[tuple[str, str, str]]) -> tuple[Fingerprint, bool]:
    columns: dict[str, set[str]] = {}
    indexes: dict[str, set[str]] = {}
    version_table = False
    for kind, table, name in rows:
        if table == VERSION_TABLE:
            version_table = True
        elif kind == "column":
            columns.setdefault(table, set()).add(name)
        else:
            indexes.setdefault(table, set()).add(name)
    return (
        Fingerprint(
            {t: frozenset(c) for t, c in columns.items()},
            {t: frozenset(i) for t, i in indexes.items() if t in columns},
        ),
        version_table,
    )


# One statement per backend, so that opening a catalog costs one round trip for the structure.
# Both return (kind, table, name) rows for the catalog tables and alembic_version.
_SQLITE = text(
    "SELECT 'column', m.name, p.name FROM sqlite_master AS m "
    "JOIN pragma_table_info(m.name) AS p "
    "WHERE m.type = 'table' AND m.name IN :tables "
    "UNION ALL "
    # sql IS NULL: an index SQLite made for a PRIMARY KEY or UNIQUE constraint.
    "SELECT 'index', tbl_name, name FROM sqlite_master "
    "WHERE type = 'index' AND sql IS NOT NULL AND tbl_name IN :tables"
).bindparams(bindparam("tables", expanding=True))

_POSTGRES = text(
    "SELECT 'column', t.relname, a.attname FROM pg_catalog.pg_class AS t "
    "JOIN pg_catalog.pg_attribute AS a ON a.attrelid = t.oid "
    "WHERE t.relnamespace = (SELECT oid FROM pg_catalog.pg_namespace "
    "WHERE nspname = current_schema()) "
    "AND t.relkind IN ('r', 'p') AND t.relname IN :tables AND a.attnum > 0 "
    "AND NOT a.attisdropped "
    "UNION ALL "
    "SELECT 'index', t.relname, i.relname FROM pg_catalog.pg_index AS x "
    "JOIN pg_catalog.pg_class AS i ON i.oid = x.indexrelid "
    "JOIN pg_catalog.pg_class AS t ON t.oid = x.indrelid "
    "WHERE t.relnamespace = (SELECT oid FROM pg_catalog.pg_namespace "
    "WHERE nspname = current_schema()) "
    "AND t.relname IN :tables "
    # An index that belongs to a constraint of its own table (primary key, unique).
    "AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint AS k "
    "WHERE k.conindid = x.indexrelid AND k.conrelid = x.indrelid)"
).bindparams(bindparam("tables", expanding=True))

_STRUCTURE = {"sqlite": _SQLITE, "postgresql": _POSTGRES}


def read_structure(connection: Connection) -> tuple[Fingerprint, bool]:
    """The catalog tables' fingerprint, and whether ``alembic_version`` exists."""
    statement = _STRUCTURE[connection.dialect.name]
    rows = connection.execute(statement, {"tables": [*CATALOG_TABLES, VERSION_TABLE]})
    return _fingerprint(tuple(row) for row in rows)


def read_revisions(connection: Connection) -> tuple[str, ...]:
    """The rows of ``alembic_version`` (the caller knows the table exists)."""
    rows = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars()
    return tuple(sorted(rows))


@functools.cache
def model_fingerprint() -> Fingerprint:
    """The fingerprint of the ORM models, i.e. of the head revision."""
    tables = Base.metadata.tables
    return Fingerprint(
        {name: frozenset(c.name for c in tables[name].columns) for name in CATALOG_TABLES},
        {
            name: frozenset(str(i.name) for i in tables[name].indexes)
            for name in CATALOG_TABLES
            if tables[name].indexes
        },
    )


def _index_ddl(index: Index, connection: Connection) -> str:
    """``CREATE INDEX`` for ``index`` in the connection's dialect, on one line."""
    return " ".join(str(CreateIndex(index).compile(dialect=connection.dialect)).split())


def repair_sql(differences: list[str], connection: Connection) -> list[str]:
    """Statements that repair ``differences`` without losing data, or [] when some cannot be
    repaired that way (a missing table or column: its data is gone).

    A missing index is recreated as the models define it; an unexpected column is dropped.
    """
    indexes = {
        str(index.name): index for table in Base.metadata.tables.values() for index in table.indexes
    }
    statements = []
    for difference in differences:
        words = difference.split()
        if difference.startswith("missing index ") and words[2] in indexes:
            statements.append(_index_ddl(indexes[words[2]], connection))
        elif difference.startswith("unexpected column "):
            table, column = words[2].split(".", 1)
            preparer = connection.dialect.identifier_preparer
            statements.append(
                f"ALTER TABLE {preparer.quote(table)} DROP COLUMN {preparer.quote(column)}"
            )
        else:
            return []
    return statements


def _only_catalog_tables(name: str | None, type_: str, _parents: Mapping[str, Any]) -> bool:
    return type_ != "table" or name in CATALOG_TABLES


def model_differences(connection: Connection) -> list[str]:
    """Alembic's ``compare_metadata`` of the live catalog tables against the ORM models, as
    phrases. Server defaults are not compared (their rendering differs between server
    versions, and the code always sends the values itself); extra indexes are ignored.
    Alembic is imported here, not with the module: opening a catalog never needs it."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    context = MigrationContext.configure(
        connection,
        opts={
            "compare_type": True,
            "compare_server_default": False,
            "include_name": _only_catalog_tables,
        },
    )
    found = []
    for entry in compare_metadata(context, Base.metadata):
        for diff in entry if isinstance(entry, list) else [entry]:
            phrase = _describe(diff)
            if phrase is not None:
                found.append(phrase)
    return found


def _describe(diff: tuple[Any, ...]) -> str | None:
    kind = diff[0]
    if kind in ("add_table", "remove_table"):
        return f"{'missing' if kind == 'add_table' else 'unexpected'} table {diff[1].name}"
    if kind in ("add_column", "remove_column"):
        what = "missing" if kind == "add_column" else "unexpected"
        return f"{what} column {diff[2]}.{diff[3].name}"
    if kind == "add_index":
        return f"missing index {diff[1].name} on {diff[1].table.name}"
    if kind == "remove_index":
        return None  # an index someone added does no harm
    if kind in ("add_constraint", "remove_constraint", "add_fk", "remove_fk"):
        constraint = diff[1]
        what = "missing" if kind.startswith("add") else "unexpected"
        noun = "foreign key" if kind.endswith("fk") else "unique constraint"
        return f"{what} {noun} {constraint.name} on {constraint.table.name}"
    if kind == "modify_type":
        return f"column {diff[2]}.{diff[3]} has type {diff[5]}, expected {diff[6]}"
    if kind == "modify_nullable":
        found, wanted = ("NULL" if v else "NOT NULL" for v in (diff[5], diff[6]))
        return f"column {diff[2]}.{diff[3]} is {found}, expected {wanted}"
    if kind in ("modify_default", "modify_comment", "add_table_comment", "remove_table_comment"):
        return None
    return f"{kind} {diff[1:]}"  # pragma: no cover - an Alembic we do not know yet
