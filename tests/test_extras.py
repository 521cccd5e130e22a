"""Each extra installs what its page uses: Zephon's wheel with one extra goes into a fresh
environment (the CPU torch wheel first where the extra needs torch, so nothing reaches for a CUDA
build), ``pip check`` passes, and the page's example runs there as printed, from a directory
outside the repository and without PYTHONPATH, so only what the extra installed is importable.

What every extra shares is installed once per session, not once per extra: Zephon's wheel with
its core dependencies (and, for the extras that need torch, with the CPU torch too) goes into a
layer with ``pip install --target``, and each extra's fresh environment sees its layer through a
``.pth`` file, as if pip had installed them there; pip then installs the extra's own packages
into the environment, and ``pip check`` checks the two together."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.wheels import build_wheel, run
from tests.zephon import doc_checks
from tests.zephon.doc_blocks import Block, block, output_of

#: the torch release this machine carries as a CPU wheel (README: Developing)
TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class Example:
    page: str
    number: int  # the block's number on its page
    first_line: str  # the start of its first line: a renumbered page fails loudly
    torch: bool  # the extra needs torch, installed first from the CPU wheel
    env: tuple[str, ...] = ()  # what the block needs from the test: "postgres"


#: extra -> the example of the page that names it
EXTRAS = {
    "torch": Example("docs/dcp.md", 2, "import tempfile", torch=True),
    "hf": Example("docs/huggingface.md", 1, "import tempfile", torch=True),
    "lightning": Example("docs/lightning.md", 1, "import lightning as L", torch=True),
    "postgres": Example("docs/catalog.md", 3, "import os", torch=False, env=("postgres",)),
    "parquet": Example("docs/pipeline.md", 11, "import os", torch=False),
    "azure": Example("docs/storage.md", 9, "from zephon.storage import", torch=False),
    "prometheus": Example("docs/goodput.md", 8, "import tempfile", torch=True),
    "ui": Example("docs/ui.md", 4, "import json", torch=False),
}


def test_every_extra_but_the_developers_and_torchtitan_has_an_example():
    import tomllib

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as handle:
        extras = set(tomllib.load(handle)["project"]["optional-dependencies"])
    # test: the developers' own; torchtitan: its own environment (.ci/torchtitan runs it)
    assert extras - {"test", "torchtitan"} == set(EXTRAS)
    for extra, example in EXTRAS.items():
        shown = block(example.page, example.number)
        assert shown.lang == "python" and shown.first_line.startswith(example.first_line), extra


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def _shared_folder(tmp_path_factory) -> Path:
    """A folder every xdist worker of this session sees (the session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _layer(tmp_path_factory, wheel: Path, torch: bool) -> Path:
    """Zephon's wheel with its core dependencies (``torch``: and the CPU torch), installed
    once per session with ``pip install --target``; the workers wait for each other."""
    from filelock import FileLock

    folder = _shared_folder(tmp_path_factory)
    layer = folder / ("layer-torch" if torch else "layer")
    with FileLock(str(layer) + ".lock"):
        if not (layer / ".complete").exists():
            shutil.rmtree(layer, ignore_errors=True)
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-compile"]
            run([*pip, "--target", str(layer), str(wheel), *([TORCH] if torch else [])], folder)
            (layer / ".complete").touch()
    return layer


@contextlib.contextmanager
def _environment(
    example: Example, code: Block, request: pytest.FixtureRequest
) -> Iterator[dict[str, str]]:
    """The reader's shell, without Zephon's settings, plus the servers the example names (S3,
    Azure: as the docs tests give them) and a PostgreSQL database where it needs one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEPHON_")}
    env.update(doc_checks.s3_env(code, request), **doc_checks.azure_env(code, request))
    if "postgres" not in example.env:
        yield env
        return
    from tests.servers import postgres_database

    with postgres_database(request.getfixturevalue("postgres_url")) as url:
        yield {**env, "ZEPHON_CATALOG_URL": url}


class ExtraAlone:
    """One extra, installed alone into a fresh environment: a class per extra (below), so that
    ``--dist loadscope`` spreads the extras over the workers instead of keeping them on one."""

    extra: str

    @pytest.mark.slow
    def test_alone_runs_its_pages_example(self, wheel, tmp_path, request):
        extra, example = self.extra, EXTRAS[self.extra]
        venv = tmp_path / "venv"
        run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
        python = str(venv / "bin" / "python")
        purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        site = Path(run([python, "-c", purelib], cwd=tmp_path).strip())
        layer = _layer(request.getfixturevalue("tmp_path_factory"), wheel, example.torch)
        (site / "zephon_layer.pth").write_text(f"{layer}\n")
        # pip of this environment, run by the new one's interpreter (--python): it sees the
        # layer. --no-compile: byte-code is written by the imports that need it.
        pip = [sys.executable, "-m", "pip", "--python", python]
        run([*pip, "install", "-q", "--no-compile", f"{wheel}[{extra}]"], cwd=tmp_path)
        run([*pip, "check"], cwd=tmp_path)
        if example.torch:
            version = run([python, "-c", "import torch; print(torch.__version__)"], tmp_path)
            assert "+cpu" in version, f"zephon[{extra}] replaced the CPU torch: {version}"

        code = block(example.page, example.number)
        script = tmp_path / "work" / "example.py"
        script.parent.mkdir()
        script.write_text(code.code)
        with _environment(example, code, request) as env:
            printed = run([python, str(script)], cwd=script.parent, env=env)
        shown = output_of(code)
        if shown is not None:
            assert printed == shown.code, f"{code.id} printed something else in zephon[{extra}]"


for _extra in EXTRAS:
    _name = f"TestExtra{_extra.capitalize()}"
    globals()[_name] = type(_name, (ExtraAlone,), {"extra": _extra})
