"""The checker of docs/ui.md's ``zephon ui`` blocks: each command is started as printed, in
a reader's directory with a catalog at ``runs/catalog.db``, with ``--port 0`` added (a fixed
port could be taken by a parallel test); its pages answer (with the token the block exports,
and only with it), then Ctrl-C stops it with exit code 0."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import urllib.error
import urllib.request

from tests.zephon.doc_blocks import Block
from tests.zephon.doc_checks import _commands, clean_env

ZEPHON = [sys.executable, "-c", "from zephon.cli import entry_point; entry_point()"]


def _status(url: str, headers: dict[str, str]) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30):
            return 200
    except urllib.error.HTTPError as error:
        return error.code


def check_ui_commands(doc: Block, request, tmp_path) -> None:
    """See the module docstring."""
    from zephon.catalog import Catalog

    (tmp_path / "runs").mkdir()
    Catalog(f"sqlite:///{tmp_path / 'runs' / 'catalog.db'}").close()
    env = clean_env()
    started = 0
    for command in _commands(doc):
        if command.startswith("export "):
            name, _, value = command.removeprefix("export ").partition("=")
            shown = subprocess.run(
                ["bash", "-c", f"printf %s {value}"], capture_output=True, text=True, check=True
            )
            env[name] = shown.stdout
            continue
        argv = shlex.split(command)
        assert argv[:2] == ["zephon", "ui"], f"{doc.id}: {command!r} is not a zephon ui command"
        process = subprocess.Popen(
            [*ZEPHON, *argv[1:], "--port", "0"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            found = re.search(r"at http://\S+:(\d+)/runs", line)
            assert found, f"{doc.id}: {command!r} printed {line!r}"
            base = f"http://127.0.0.1:{found.group(1)}"
            token = env.get("ZEPHON_UI_TOKEN")
            if "--allow-remote" in argv:
                assert token and len(token) >= 16, f"{doc.id}: no token exported"
                assert "(token required)" in line and token not in line
                assert _status(f"{base}/runs", {}) == 401
            headers = {"authorization": f"Bearer {token}"} if token else {}
            assert _status(f"{base}/runs", headers) == 200
        finally:
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=30)
        assert process.returncode == 0, f"{doc.id}: {command!r} exited {process.returncode}: {err}"
        started += 1
    assert started, f"{doc.id} starts no zephon ui"
