"""The layers stay honest, read from the source: storage knows nothing of the catalog or torch,
the catalog nothing of fsspec or storage, and zephon uses only their public APIs (the names of
``storage/__init__.py`` and ``catalog/__init__.py``, never a module inside them).

The layers' folders install as ``zephon.storage``, ``zephon.catalog`` and ``zephon.migrations``
(pyproject's package-dir): ``layer_of`` names the layer an imported module belongs to."""

from __future__ import annotations

import ast
import glob
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the layers installed under zephon's namespace: module prefix -> layer (its folder)
NAMESPACED = {
    "zephon.storage": "storage",
    "zephon.catalog": "catalog",
    "zephon.migrations": "migrations",
}

#: layer -> layers and top-level packages its modules may not import
FORBIDDEN = {
    "storage": {"catalog", "migrations", "zephon", "torch", "sqlalchemy", "alembic"},
    "catalog": {"storage", "zephon", "torch", "fsspec"},
}


def layer_of(module: str) -> str:
    """The layer (or top-level package) of an imported module: ``zephon.storage.layout`` ->
    ``storage``, ``zephon.dcp`` -> ``zephon``, ``fsspec.spec`` -> ``fsspec``."""
    for prefix, layer in NAMESPACED.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return module.split(".")[0]


def test_layer_of_tells_a_namespaced_layer_from_zephon_itself():
    assert layer_of("zephon.storage.layout") == "storage"
    assert layer_of("zephon.catalog") == "catalog"
    assert layer_of("zephon.storagex") == "zephon"
    assert layer_of("zephon") == "zephon"
    assert layer_of("storage") == "storage"


def imports_of(path: str) -> list[tuple[int, str]]:
    """Every module a file imports, with its line (``from a.b import c`` gives ``a.b``, and
    ``from zephon import storage`` the layer ``zephon.storage``)."""
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            layers = [f"zephon.{a.name}" for a in node.names if f"zephon.{a.name}" in NAMESPACED]
            if node.module == "zephon" and layers:  # from zephon import catalog: that layer
                found += [(node.lineno, layer) for layer in layers]
            else:
                found.append((node.lineno, node.module))
    return found


def sources(layer: str) -> list[str]:
    return sorted(glob.glob(os.path.join(REPO, layer, "**", "*.py"), recursive=True))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_lower_layer_imports_nothing_above_it(layer):
    wrong = [
        f"{os.path.relpath(path, REPO)}:{line} imports {module}"
        for path in sources(layer)
        for line, module in imports_of(path)
        if layer_of(module) in FORBIDDEN[layer]
    ]
    assert not wrong, "\n".join(wrong)


def test_zephon_uses_only_the_public_api_of_storage_and_catalog():
    wrong = [
        f"{os.path.relpath(path, REPO)}:{line} imports {module}: import the name from "
        f"zephon.{layer_of(module)} itself (export it there if it is not)"
        for path in sources("zephon")
        for line, module in imports_of(path)
        if layer_of(module) in {"storage", "catalog"}
        and module not in {"zephon.storage", "zephon.catalog"}
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_layer_imported_from_zephon(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from zephon import catalog as c, storage\nfrom zephon import dcp\n")
    assert imports_of(str(module)) == [(1, "zephon.catalog"), (1, "zephon.storage"), (2, "zephon")]


def test_the_check_sees_a_submodule_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom zephon.storage.layout import validate_run\n")
    assert imports_of(str(module)) == [(1, "os"), (2, "zephon.storage.layout")]


#: zephon's packages below others: package (or module) -> zephon packages it may not import
ZEPHON_BELOW = {
    "zephon/destinations": {"zephon.checkpointing", "zephon.dcp"},
    "zephon/collectives.py": {"zephon.checkpointing", "zephon.dcp"},
    "zephon/dcp": {"zephon.checkpointing"},
}


@pytest.mark.parametrize("below", sorted(ZEPHON_BELOW))
def test_destinations_and_dcp_import_nothing_of_the_packages_above_them(below):
    """Where saves go (``zephon.destinations``, ``zephon.collectives``) sits below both the
    checkpoint manager and ``zephon.dcp``, and ``zephon.dcp`` below the manager: no circle."""
    where = os.path.join(REPO, below)
    paths = [where] if where.endswith(".py") else sources(below)
    assert paths, f"{below} has no sources"
    wrong = [
        f"{os.path.relpath(path, REPO)}:{line} imports {module}"
        for path in paths
        for line, module in imports_of(path)
        if any(
            module == banned or module.startswith(f"{banned}.") for banned in ZEPHON_BELOW[below]
        )
    ]
    assert not wrong, "\n".join(wrong)


#: storage module -> the storage modules that alone may import it: the store builds run stores,
#: the run store composes the satellites, and nothing below imports back up (the package's
#: ``__init__`` re-exports both)
STORAGE_ABOVE = {
    "zephon.storage.store": {"storage/__init__.py"},
    "zephon.storage.run_store": {"storage/__init__.py", "storage/store.py"},
}


def test_storages_store_and_run_store_are_imported_only_from_above():
    """No circle among ``storage.store``, ``storage.run_store`` and the modules they compose
    (writer, reader, markers, existing, leftovers...): every import counts, also one made only
    under ``TYPE_CHECKING`` or inside a function, and ``from zephon.storage import ...`` (the
    package, which imports both) is refused inside storage."""
    wrong = []
    for path in sources("storage"):
        where = os.path.relpath(path, REPO).replace(os.sep, "/")
        for line, module in imports_of(path):
            allowed = STORAGE_ABOVE.get(module)
            if (allowed is not None and where not in allowed) or module == "zephon.storage":
                wrong.append(f"{where}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_storage_check_sees_an_import_made_for_type_checking_only(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from zephon.storage.store import X\n"
    )
    assert (3, "zephon.storage.store") in imports_of(str(module))


#: the libraries of the storage backends: only storage/backends/ calls them
BACKEND_LIBRARIES = {"fsspec", "s3fs", "gcsfs", "adlfs", "azure", "botocore", "aiohttp"}


def runtime_imports_of(path: str) -> list[tuple[int, str]]:
    """``imports_of`` without the imports made under ``if TYPE_CHECKING:`` (annotations only)."""
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    for_types = {
        node.lineno
        for block in ast.walk(tree)
        if isinstance(block, ast.If)
        and isinstance(block.test, ast.Name)
        and block.test.id == "TYPE_CHECKING"
        for node in ast.walk(block)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    return [(line, module) for line, module in imports_of(path) if line not in for_types]


def test_only_the_backend_classes_call_fsspec():
    backends = os.path.join(REPO, "storage", "backends")
    wrong = [
        f"{os.path.relpath(path, REPO)}:{line} imports {module}: call a backend method instead "
        "(storage/backends/ translates its errors and retries it)"
        for layer in ("storage", "catalog", "zephon")
        for path in sources(layer)
        if not path.startswith(backends + os.sep)
        for line, module in runtime_imports_of(path)
        if module.split(".")[0] in BACKEND_LIBRARIES
    ]
    assert not wrong, "\n".join(wrong)


def test_the_fsspec_check_sees_a_runtime_import_and_passes_one_for_types(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nimport fsspec\n"
        "if TYPE_CHECKING:\n    from fsspec.spec import AbstractFileSystem\n"
    )
    assert runtime_imports_of(str(path)) == [(1, "typing"), (2, "fsspec")]
