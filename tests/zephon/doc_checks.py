"""How each kind of documentation block is run (see tests/zephon/test_docs.py).

``CHECKS`` maps a block that needs more than "run it" to its checker; every checker's docstring
says what it runs, and, for the long commands (benchmarks, ``zephon demo``), whether they run
with their smallest flags or are only parsed (``--help``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import zygote
from tests.zephon.doc_blocks import REPO, Block, block, output_of

#: what the interpreter each Python block is forked from imported: torch, nothing of Zephon
#: (whose imports read the block's own environment)
DOCS_PRELOAD = ("torch",)

Checker = Callable[[Block, pytest.FixtureRequest, Path], None]
_BUCKET = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?=[/\"'])")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a reader's shell: this one, minus Zephon's own settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEPHON_")}
    env["PYTHONPATH"] = REPO
    env.update(extra)
    return env


def s3_env(doc: Block, request: pytest.FixtureRequest) -> dict[str, str]:
    """For a block naming ``s3://BUCKET/...``: the moto server's endpoint and keys where s3fs
    reads them (botocore's ``AWS_ENDPOINT_URL``, passed on by aiobotocore), the buckets made."""
    if "s3://" not in doc.code:
        return {}
    server = request.getfixturevalue("s3")
    for bucket in sorted(set(_BUCKET.findall(doc.code))):
        server.create_bucket(bucket)  # idempotent: blocks of one session share the server
    return {
        "AWS_ENDPOINT_URL": server.endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


_CONTAINER = re.compile(r"az://([a-z0-9][a-z0-9-]{1,61}[a-z0-9])(?=[/\"'])")


def azure_env(doc: Block, request: pytest.FixtureRequest) -> dict[str, str]:
    """For a block naming ``az://CONTAINER/...``: Azurite's connection string where adlfs reads
    it (``AZURE_STORAGE_CONNECTION_STRING``), the containers made."""
    if "az://" not in doc.code:
        return {}
    server = request.getfixturevalue("azurite")
    for container in sorted(set(_CONTAINER.findall(doc.code))):
        server.create_container(container)  # idempotent: blocks of one session share it
    return {"AZURE_STORAGE_CONNECTION_STRING": server.connection_string}


def zephon_command() -> str:
    """The ``zephon`` console script of this environment (what the reader's venv puts on PATH)."""
    return os.path.join(os.path.dirname(sys.executable), "zephon")


def prepare(tmp_path: Path) -> None:
    """A reader's working directory: the repository's examples/ (pages load examples/job.yaml)."""
    shutil.copytree(os.path.join(REPO, "examples"), tmp_path / "examples")


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 240):
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_python(doc: Block, request: pytest.FixtureRequest, tmp_path: Path, **env: str) -> None:
    """Run the block as printed in a process of its own (``env`` added to a reader's shell's),
    forked from an interpreter that has imported torch and nothing else (tests/zygote.py); its
    shown output must match exactly."""
    prepare(tmp_path)
    script = tmp_path / "example.py"
    script.write_text(doc.code)
    env = clean_env(**s3_env(doc, request), **azure_env(doc, request), **env)
    done = zygote.run([str(script)], cwd=tmp_path, env=env, timeout=240, preload=DOCS_PRELOAD)
    assert done.returncode == 0, f"{doc.id} failed:\n{done.stderr[-3000:]}"
    shown = output_of(doc)
    if shown is not None:
        assert done.stdout == shown.code, f"{doc.id} printed something else than {shown.id}"


def load_yaml(doc: Block, tmp_path: Path):
    """Load the block with ``zephon.load_job_config``; a fragment of ``trainer:`` alone gets
    the run name it needs (nothing else is added)."""
    import yaml

    import zephon

    tree = yaml.safe_load(doc.code)
    tree.setdefault("run", {"name": "doc-run"})
    return zephon.load_job_config(tree)


# -- install and test commands: the same as CI's ---------------------------------------------


def _ci_commands(script: str) -> list[str]:
    """The script's command lines, a leading ``time`` (CI records each phase's time) dropped."""
    with open(os.path.join(REPO, ".ci", script)) as handle:
        lines = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
    return [line.removeprefix("time ") for line in lines]


def _without_quiet(command: str) -> str:
    return " ".join(word for word in command.split() if word not in ("-q", "-rfEs", "-rfEsx"))


def _commands(doc: Block) -> list[str]:
    """The block's commands: comments dropped, ``&&`` chains and continuations split."""
    text = doc.code.replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            found.extend(part.strip() for part in line.split("&&"))
    return found


def check_install(doc: Block, script: str = "run") -> list[str]:
    """The block's install lines (venv, activate, pip) are lines of .ci/<script> (its ``-q``
    and report flags aside); a block that runs the tests installs exactly CI's extras. Returns
    the other commands, which the caller runs."""
    ci = [_without_quiet(line) for line in _ci_commands(script)]
    rest = []
    commands = _commands(doc)
    for command in commands:
        if command.startswith(("python3 -m venv", ". ", "pip install")):
            if command.startswith("pip install -e") and not any(
                c.startswith("pytest") for c in commands
            ):
                # installing a subset of CI's extras (the quick start) is fine
                extras = set(re.search(r"\[(.*?)\]", command).group(1).split(","))
                ci_extras = {
                    e
                    for c in ci
                    if c.startswith("pip install -e")
                    for e in re.search(r"\[(.*?)\]", c).group(1).split(",")
                }
                assert extras <= ci_extras, f"{doc.id}: {command!r} installs what CI does not"
            else:
                assert command in ci, f"{doc.id}: {command!r} is not what .ci/{script} runs: {ci}"
        elif command.startswith(("pytest", "ZEPHON_REQUIRE_TORCHTITAN=1 pytest")):
            assert _without_quiet(command) in ci, (
                f"{doc.id}: {command!r} is not .ci/{script}'s test command"
            )
        else:
            rest.append(command)
    return rest


def check_install_only(doc: Block, request, tmp_path) -> None:
    """Install and test commands: compared with .ci/run, not re-run (the suite is running)."""
    assert check_install(doc) == []


def check_torchtitan_install(doc: Block, request, tmp_path) -> None:
    """docs/torchtitan.md's environment: the lines of .ci/torchtitan."""
    assert check_install(doc, "torchtitan") == []


TORCHTITAN_TARGET = "zephon.integrations.torchtitan.zephon_checkpointer"


def check_torchtitan_launch(doc: Block, request, tmp_path) -> None:
    """docs/torchtitan.md's 8-GPU launch cannot run here: what it asks of Zephon is checked.
    The ``--override.imports`` target is a module-level name of zephon/integrations/
    torchtitan.py, and the CPU run that .ci/torchtitan executes (block 3) imports the same."""
    import ast

    assert f"--override.imports {TORCHTITAN_TARGET}" in doc.code
    module, _, name = TORCHTITAN_TARGET.rpartition(".")
    with open(os.path.join(REPO, *module.split(".")) + ".py") as handle:
        tree = ast.parse(handle.read())
    assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    assert f'"{TORCHTITAN_TARGET}=' in block(doc.page, 3).code


def check_torchtitan_run(doc: Block, request, tmp_path) -> None:
    """docs/torchtitan.md's CPU run needs .venv-torchtitan (torchtitan caps fsspec below this
    environment's): .ci/torchtitan runs tests/zephon/integrations/test_torchtitan.py there,
    whose test_docs_example_runs_as_printed runs the page's first bash block (this one) and
    compares its output with the block after "prints"."""
    with open(os.path.join(REPO, doc.page)) as handle:
        page = handle.read()
    assert page.split("```bash\n", 1)[1].startswith(doc.code)
    with open(os.path.join(REPO, "tests/zephon/integrations/test_torchtitan.py")) as handle:
        test = handle.read()
    assert "def test_docs_example_runs_as_printed(" in test
    assert 'text.split("```bash\\n", 1)[1]' in test
    with open(os.path.join(REPO, ".ci/torchtitan")) as handle:
        ci = handle.read()
    assert "ZEPHON_REQUIRE_TORCHTITAN=1" in ci
    assert "tests/zephon/integrations/test_torchtitan.py" in ci


def check_quick_start(doc: Block, request, tmp_path) -> None:
    """Install lines compared with .ci/run; ``zephon demo`` (40 s of 2 ranks) is checked by
    ``--help`` parsing only (tests/zephon/test_cli.py runs it), with the flags README names."""
    assert check_install(doc) == ["zephon demo"]
    done = run([zephon_command(), "demo", "--help"], tmp_path, clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(REPO, "README.md")) as handle:
        prose = handle.read().split("`zephon demo` trains", 1)[1].split("\n\n", 1)[0]
    for flag in re.findall(r"--[a-z][a-z-]*", prose):
        assert flag in done.stdout, f"README names zephon demo {flag}, which it does not take"


_HELP = """
import contextlib, io, os, runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, os.path.dirname(path))  # as `python path` has it
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            assert exc.code in (0, None), (path, exc.code)
    print(repr(out.getvalue()))
"""


def helps(scripts: list[str], tmp_path: Path) -> dict[str, str]:
    """Each script's ``--help`` output, all parsed in one interpreter (they are argparse
    programs: ``--help`` prints and exits before any work)."""
    import ast

    paths = [os.path.join(REPO, script) for script in scripts]
    done = run([sys.executable, "-c", _HELP, *paths], tmp_path, clean_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = [ast.literal_eval(line) for line in done.stdout.splitlines()]
    return dict(zip(scripts, outputs, strict=True))


def check_benchmarks(doc: Block, request, tmp_path) -> None:
    """Benchmarks (minutes each): checked by ``--help`` parsing only; every flag a command's
    line names (in its comment too) must be one its script's ``--help`` lists."""
    lines = [line for line in doc.code.splitlines() if line.startswith("python ")]
    assert lines, f"{doc.id} names no benchmark"
    scripts = [line.split()[1] for line in lines]
    assert all(script.startswith("benchmarks/") for script in scripts), scripts
    usage = helps(scripts, tmp_path)
    for line, script in zip(lines, scripts, strict=True):
        for flag in re.findall(r"--[a-z][a-z0-9-]*", line):
            assert flag in usage[script], f"{doc.id}: {script} has no {flag}"


def check_usage(doc: Block, request, tmp_path) -> None:
    """A benchmark's synopsis (``python benchmarks/x.py [--flag N] ...``): ``--help`` parsing
    only; every flag shown exists."""
    script = doc.code.split()[1]
    usage = helps([script], tmp_path)[script]
    for flag in re.findall(r"--[a-z][a-z0-9-]*", doc.code):
        assert flag in usage, f"{doc.id}: {script} has no {flag}"


def check_pipeline_examples(doc: Block, request, tmp_path) -> None:
    """Runs both examples as printed, from a copy of examples/."""
    prepare(tmp_path)
    for command in _commands(doc):
        done = run(shlex.split(command.replace("python", sys.executable, 1)), tmp_path, clean_env())
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"


def check_readme_yaml(doc: Block, request, tmp_path) -> None:
    """README's job config is examples/job.yaml (its header comment aside), and loads."""
    with open(os.path.join(REPO, "examples", "job.yaml")) as handle:
        lines = handle.read().splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    assert doc.code == "".join(lines)
    job = load_yaml(doc, tmp_path)
    assert (job.run_name, job.total_steps) == ("example-run", 40)


def check_pipeline_state(doc: Block, request, tmp_path) -> None:
    """The state shown is what the quick start's pipeline checkpoints after 10 batches."""
    namespace: dict = {}
    exec(compile(block("docs/pipeline.md", 2).code, "docs/pipeline.md#2", "exec"), namespace)
    pipeline = namespace["build"]()
    batches = iter(pipeline)
    for _ in range(10):
        next(batches)
    assert pipeline.checkpoint() == json.loads(doc.code)
    pipeline.close()


def check_dcp_metadata(doc: Block, request, tmp_path) -> None:
    """The shown dcp_metadata.json has the fields a real save of a model and its optimizer
    writes, at every level (values differ: sizes, checksums)."""
    shown = json.loads(doc.code)
    script = tmp_path / "save.py"
    script.write_text(
        "import json, sys, torch\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from zephon import dcp as zd\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 32))\n"
        "optim = torch.optim.Adam(model.parameters())\n"
        "model(torch.ones(1, 16)).sum().backward(); optim.step()\n"
        "state = {'model': model.state_dict(), 'optim': optim.state_dict()}\n"
        "url = sys.argv[1] + '/ckpt/run'\n"
        "dcp.save(state, storage_writer=zd.Writer(url, step=100))\n"
        "reader = zd.Reader(url)\n"
        "store = reader.store\n"
        "r = store.run('run').reader(100)\n"
        "name = next(f.name for f in r.manifest.files if f.name.endswith('dcp_metadata.json'))\n"
        "sys.stdout.write(r.read_bytes(name).decode())\n"
    )
    done = run([sys.executable, str(script), str(tmp_path)], tmp_path, clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    real = json.loads(done.stdout)
    assert real.keys() == shown.keys()
    assert {k: real[k] for k in ("format", "format_version")} == {
        k: shown[k] for k in ("format", "format_version")
    }

    def by_kind(items, kind):  # the fields of each kind of entry (a tensor, bytes; raw, bytes)
        return {item[kind]: item.keys() for item in items}

    real_items = by_kind(real["state_dict_metadata"].values(), "kind")
    assert by_kind(shown["state_dict_metadata"].values(), "kind").items() <= real_items.items()
    assert real["planner_data"].keys() == shown["planner_data"].keys()
    real_data = by_kind(real["storage_data"], "encoding")
    assert by_kind(shown["storage_data"], "encoding").items() <= real_data.items()
    assert real["storage_meta"].keys() == shown["storage_meta"].keys()


def check_reshard(doc: Block, request, tmp_path) -> None:
    """Run on 4 gloo ranks and loaded on 2 by tests/zephon/dcp/test_reshard.py, whose worker
    executes this very block (read from the page) under torchrun's env:// rendezvous and
    compares rank 0's output with the two blocks after it. Here: only that it still runs this
    block as printed, so the page's 6 processes are not started twice."""
    from tests.zephon.dcp import reshard_worker, test_reshard

    assert reshard_worker.docs_example() == doc.code
    assert test_reshard.test_the_manager_docs_example_prints_what_the_page_says
    assert block(doc.page, doc.number + 1).output_of == doc.number


def check_tiers_table(doc: Block, request, tmp_path) -> None:
    """``zephon checkpoints killed`` (80 columns) on a catalog holding what the page describes:
    step 1 on save_dir only, step 2 on this node's local tier and on save_dir; the table has
    the page's title, header and rows (sizes, durations and MB/s aside)."""
    import socket

    from tests.zephon.doc_readme import compare_table
    from zephon.catalog import Catalog

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with Catalog(url) as cat:
        cat.ensure_run("killed", "s3://bucket/ckpt")
        for step, tiers in ((1, ["save_dir"]), (2, ["local", "save_dir"])):
            row = cat.begin_checkpoint("killed", step, f"s3://bucket/ckpt/killed/save-{step}")
            for tier in tiers:
                host = socket.gethostname() if tier == "local" else ""
                where = f"/local/killed/save-{step}" if tier == "local" else row.path
                cat.replica_started(
                    "killed", step, tier=tier, host=host, location=where, save_id=row.save_id
                )
                cat.replica_committed(
                    "killed", step, tier=tier, host=host, save_id=row.save_id, bytes=44339
                )
            cat.mark_committed(
                "killed", step, row.save_id, bytes=44339, file_count=7, manifest_checksum="c",
                timings={"total_s": 0.5, "write_s": 0.3, "commit_s": 0.1},
            )  # fmt: skip
    done = run(
        [zephon_command(), "checkpoints", "killed", "--catalog", url],
        tmp_path,
        clean_env(COLUMNS="80"),
    )
    assert done.returncode == 0, done.stderr
    compare_table(doc.code, done.stdout)


def check_multinode_launch(doc: Block, request, tmp_path) -> None:
    """Parsed only (two nodes, S3 and PostgreSQL of the reader's; tests/zephon/multinode runs
    the job on one machine): SPEC is an ``ElasticSpec``, and every launch line's arguments are
    ones ``torch.distributed.run``'s parser accepts, running ``zephon.demo.elastic_job``."""
    from torch.distributed.run import get_args_parser

    from zephon.demo.elastic_job import ElasticSpec

    text = doc.code.replace("\\\n", " ")
    spec = re.search(r"SPEC='(.*?)'", text, re.S).group(1)
    ElasticSpec(**json.loads(spec))
    launches = [line.split() for line in text.splitlines() if "torch.distributed.run" in line]
    assert len(launches) == 3
    for words in launches:
        assert words[:3] == ["python", "-m", "torch.distributed.run"]
        args = get_args_parser().parse_args(words[3:])
        assert args.module and args.training_script == "zephon.demo.elastic_job"
        assert args.training_script_args == ['"$SPEC"'] and args.rdzv_id == "elastic-1"


def check_adopt_commands(doc: Block, request, tmp_path) -> None:
    """Runs ``zephon adopt`` as printed, against the moto server, in a directory holding the
    stock checkpoints the block names, written by torch's own ``FileSystemWriter``
    (``outputs/checkpoint/step-100`` and ``step-200``, ``exported/step-900``); then the run
    holds the three steps, and ``zd.Reader`` loads the latest."""
    import torch
    import torch.distributed.checkpoint as dcp

    for path, step in (
        ("outputs/checkpoint/step-100", 100),
        ("outputs/checkpoint/step-200", 200),
        ("exported/step-900", 900),
    ):
        state = {"w": torch.full((4,), float(step)), "extra": {"step": step}}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / path)))
    env = clean_env(**s3_env(doc, request))
    outputs = []
    for command in _commands(doc):
        words = shlex.split(command)
        assert words[0] == "zephon"
        done = run([zephon_command(), *words[1:]], tmp_path, env)
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
        outputs.append(done.stdout)
    assert outputs[0].startswith("adopted step 100 from ")
    assert json.loads(outputs[1])["adopted"] == [900]
    assert [line.split()[:2] for line in outputs[2].splitlines()[2:]] == [
        ["100", "committed"],
        ["200", "committed"],
        ["900", "committed"],
    ]


def shown_by(number: int) -> Checker:
    def check(doc: Block, request, tmp_path) -> None:
        """An output compared by the test of the block that prints it."""
        assert block(doc.page, number).lang == "python"

    check.__doc__ = f"the output of block {number}, compared by that block's test"
    return check


def _catalog_check(doc: Block, request, tmp_path) -> None:
    from tests.zephon.doc_catalog import check

    check(doc, request, tmp_path)


def check_postgres_catalog(doc: Block, request, tmp_path) -> None:
    """Run as printed with ``ZEPHON_CATALOG_URL`` naming a new database on the PostgreSQL
    server the tests use (tests/servers.py)."""
    from tests.servers import postgres_database

    with postgres_database(request.getfixturevalue("postgres_url")) as url:
        run_python(doc, request, tmp_path, ZEPHON_CATALOG_URL=url)


def _readme_check(doc: Block, request, tmp_path) -> None:
    from tests.zephon.doc_readme import check

    check(doc, request, tmp_path)


def _ui_check(doc: Block, request, tmp_path) -> None:
    """docs/ui.md's ``zephon ui`` commands, started and stopped (tests/zephon/doc_ui.py)."""
    from tests.zephon.doc_ui import check_ui_commands

    check_ui_commands(doc, request, tmp_path)


CHECKS: dict[tuple[str, int], tuple[str, Checker]] = {
    ("README.md", 1): ("python3 -m venv .venv && . .venv/bin/activate", check_quick_start),
    ("README.md", 2): ("pip install -e '.[torch,test,hf,lightning]'", check_install_only),
    ("README.md", 4): ("run: {name: example-run}", check_readme_yaml),
    ("README.md", 5): ("python examples/train.py examples/job.yaml", _readme_check),
    ("README.md", 6): ("export ZEPHON_CATALOG_URL=sqlite:///runs/catalog.db", _readme_check),
    ("README.md", 7): ("$ zephon checkpoints example-run", _readme_check),
    ("README.md", 9): (
        "python examples/pipeline_checkpoint.py",
        check_pipeline_examples,
    ),
    ("README.md", 8): ("0 * * * * ZEPHON_CATALOG_URL=postgresql+psycopg://", _readme_check),
    ("README.md", 10): (
        "python benchmarks/storage_throughput.py",
        check_benchmarks,
    ),
    ("docs/storage.md", 11): (
        "python benchmarks/round_trips.py",
        check_benchmarks,
    ),
    ("docs/dcp.md", 13): (
        "python benchmarks/save_restore.py [--mib 1024]",
        check_usage,
    ),
    ("docs/catalog.md", 3): ("import os", check_postgres_catalog),
    ("docs/catalog.md", 5): ("SELECT step, path FROM checkpoints", _catalog_check),
    ("docs/catalog.md", 6): (
        "invalid num_to_keep 1000000000000000000000000000000: expected an integer from 1 to"
        " 2147483647, or None",
        _catalog_check,
    ),
    ("docs/catalog.md", 9): (
        "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE at < :cutoff ORDER BY at"
        " LIMIT :n)",
        _catalog_check,
    ),
    ("docs/catalog.md", 11): (
        "invalid timings phase 'write': expected one of stall_s, stage_s, write_s, commit_s,"
        " total_s, local_s, upload_s",
        _catalog_check,
    ),
    ("docs/catalog.md", 17): (
        "run 'r1' in catalog sqlite:///...: attempt epoch 3 is no longer current: attempt epoch 5"
        " (host h1,",
        _catalog_check,
    ),
    ("docs/tiers.md", 2): ("checkpoints of run killed in s3://bucket/ckpt", check_tiers_table),
    ("docs/multinode.md", 1): (
        'SPEC=\'{"save_dir": "s3://bucket/ckpt",',
        check_multinode_launch,
    ),
    ("docs/README.md", 3): ("python3 -m venv .venv && . .venv/bin/activate", check_install_only),
    ("docs/pipeline.md", 13): ("{", check_pipeline_state),
    ("docs/dcp.md", 10): ("{", check_dcp_metadata),
    ("docs/dcp.md", 16): (
        "zephon adopt outputs/checkpoint s3://bucket/ckpt/llama-run --catalog sqlite:///catalog.db",
        check_adopt_commands,
    ),
    ("docs/manager.md", 6): ("import sys", check_reshard),
    ("docs/manager.md", 8): (
        "resumed step 1; data and rank_state per rank: [({'rank': 0}, None), ({'rank': 0}, None)]",
        shown_by(6),
    ),
    ("docs/torchtitan.md", 1): (
        "torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config llama3_8b \\",
        check_torchtitan_launch,
    ),
    ("docs/torchtitan.md", 2): (
        "python3 -m venv .venv-torchtitan && . .venv-torchtitan/bin/activate",
        check_torchtitan_install,
    ),
    ("docs/torchtitan.md", 3): (". .venv-torchtitan/bin/activate", check_torchtitan_run),
    ("docs/ui.md", 1): ("zephon ui --catalog sqlite:///runs/catalog.db", _ui_check),
    ("docs/ui.md", 2): ('export ZEPHON_UI_TOKEN="$(python3 -c', _ui_check),
    ("docs/ui.md", 3): ("python benchmarks/ui_pages.py", check_benchmarks),
}
