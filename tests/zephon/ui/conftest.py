"""Fixtures of the dashboard's tests: one catalog filled by real runs of the checkpoint
manager (``filled.py``) per session, and ``zephon ui`` served over it by a real process."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.zephon.ui.filled import fill

#: the ``zephon`` command as a process of its own (the entry point of the installed package)
ZEPHON = [sys.executable, "-c", "from zephon.cli import entry_point; entry_point()"]


@dataclass
class Served:
    """A running ``zephon ui``: its base URL, the catalog's URL and database file."""

    base: str
    catalog_url: str
    database: str
    process: subprocess.Popen


@pytest.fixture(scope="session")
def filled(tmp_path_factory) -> tuple[str, str]:
    """``(catalog URL, database file)`` of the catalog ``filled.fill`` made."""
    root = str(tmp_path_factory.mktemp("ui-runs"))
    url = fill(root)
    return url, os.path.join(root, "catalog.db")


def start(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``zephon ui ARGV``; the process and the base URL its start line names."""
    process = subprocess.Popen(
        [*ZEPHON, "ui", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    found = re.search(r"at (http://\S+:\d+)/runs", line)
    if found is None:
        process.kill()
        _, err = process.communicate(timeout=10)
        raise AssertionError(f"zephon ui did not start: {line!r} {err!r}")
    return process, found.group(1)


def stop(process: subprocess.Popen) -> str:
    """Stop a ``zephon ui`` as Ctrl-C would; its remaining stderr."""
    process.send_signal(2)
    try:
        _, err = process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return err


@pytest.fixture(scope="module")
def served(filled) -> Iterator[Served]:
    """``zephon ui --port 0`` over the filled catalog, for one test module."""
    url, database = filled
    process, base = start(["--catalog", url, "--port", "0"])
    try:
        yield Served(base, url, database, process)
    finally:
        stop(process)


def chromium_or_skip() -> str:
    """Debian's chromium; under CI its absence fails (``.ci/run`` installs it)."""
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        message = "no /usr/bin/chromium: apt-get install -y chromium chromium-driver"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


#: flags for a headless chromium on a machine without network: nothing reaches out
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless chromium (a fresh profile) per test module, driven by playwright."""
    executable = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    profile = str(tmp_path_factory.mktemp("chromium-profile"))
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=executable,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1200, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)
