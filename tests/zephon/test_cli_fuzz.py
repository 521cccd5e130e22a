"""Fuzzing ``zephon``: no argument list and no commit marker makes it exit 70 or raise.

Run in-process through ``zephon.cli.main`` against a SQLite catalog and a local storage root
holding a run with checkpoints. Bounded and deterministic (``derandomize=True``): a few hundred
examples in well under a minute, the same ones on every run, so CI stays stable.

Paths and URLs are drawn from a fixed pool: hypothesis's text goes into names, steps, durations
and JSON, never into a path that ``sync`` would scan or ``export`` would create (as root, a
random absolute path is anywhere on the machine), and never into a host name that would wait
for DNS.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.zephon.saves import save_step, start
from tests.zephon.test_composition import make_run
from zephon.catalog import Catalog
from zephon.cli import main
from zephon.storage.layout import MARKER_NAME

COMMANDS = ["runs", "checkpoints", "latest", "verify", "gc", "sync", "pin", "unpin", "db", "export"]
FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
def world(tmp_path, monkeypatch, local_backend, s3):
    """A SQLite catalog and a local storage root with run ``r`` (steps 10, 20, 30); the working
    directory is a fresh one, S3 URLs go to the moto server and no traceback is let through."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("ZEPHON_DEBUG", raising=False)
    monkeypatch.delenv("ZEPHON_STORAGE_OPTIONS", raising=False)
    monkeypatch.setenv("ZEPHON_CATALOG_URL", url)
    # an s3:// URL with any bucket reaches moto, never AWS
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with Catalog(url) as catalog:
        location = make_run(catalog, local_backend, num_to_keep=None)
        attempt = start(location, catalog)
        for step in (10, 20, 30):
            save_step(attempt, step, catalog)
    return {"root": local_backend.url, "catalog": url, "tmp": str(tmp_path)}


def run_zephon(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit code, stdout, stderr; the properties every invocation must have are checked."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
        assert exc.code in (0, 2), (argv, exc.code)
        code = exc.code
    out, err = capsys.readouterr()
    event(
        f"{argv[0] if argv[0] in COMMANDS else '(other)'} exit {code}"
    )  # --hypothesis-show-statistics
    assert code != 70, (argv, err)
    if err:
        assert err.startswith("zephon: error: ") and err.count("\n") == 1, (argv, err)
    if code in (2, 4, 5, 6):
        assert err, (argv, code, out)
    return code, out, err


# -- the argument space ----------------------------------------------------------------------

SPECIAL_TEXT = [
    "",
    " ",
    "-",
    "--",
    "r",
    "never-seen",
    ".",
    "..",
    "../..",
    "_attempts",
    "save-5",
    "a b",
    "[/]",
    "[bold]x[/bold]",
    ":smile:",
    "%s%n",
    "\x00",
    "\n",
    "\x1b[2J",
    "😀",
    "x" * 300,
]
NUMBERS = [
    "0",
    "-1",
    "10",
    "20",
    "9223372036854775807",
    "9223372036854775808",
    "99999999999999999999999",
    "1e400",
    "nan",
    "inf",
    "-0",
    "0x10",
    "1_000",
    "9" * 5000,
]
DURATIONS = ["0", "0s", "1h", "24h", "3650d", "3651d", "999999999999w", "1.5m", "-1h", "1y"]
SIZES = ["0", "1", "5GB", "500MiB", "1PiB", "2PiB", "99999999999999999PB", "1.5kb", "-5"]
STATES = ["pending", "committed", "deleting", "deleted", "failed", "corrupt", "stale", "bogus"]
JSON_SPECIAL = [
    '{"client_kwargs": 5}',
    '{"bogus_option": 1}',
    '{"client_kwargs": {"endpoint_url": 5}}',
    '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}',
    '{"anon": "yes"}',
    '{"auto_mkdir": "x"}',
    "{bad",
    "[1]",
    "null",
    '"s3"',
    "[" * 5000,
    '{"n": ' + "9" * 5000 + "}",
    "{}",
]
URL_PREFIXES = [
    "memory://",
    "ftp://127.0.0.1:1/",
    "http://127.0.0.1:1/",
    "sftp://127.0.0.1:1/",
    "hdfs://127.0.0.1:1/",
    "github://",
    "dbfs://",
    "reference://",
    "zip://",
    "tar://",
    "data://",
    "dir://",
    "simplecache://",
    "abfs://c/",
    "s3://",
    "nosuch://",
    "::",
]
CATALOGS = [
    "sqlite:////proc/nope/c.db",
    "sqlite://",
    "sqlite:///:memory:",
    "postgresql+psycopg://postgres:secret@127.0.0.1:1/nope",
    "mysql://u@127.0.0.1:1/x",
    "not a url",
    "",
]

texts = st.one_of(st.sampled_from(SPECIAL_TEXT), st.text(max_size=20))
numbers = st.one_of(
    st.sampled_from(NUMBERS), st.integers(min_value=-(10**30), max_value=10**30).map(str)
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
json_texts = st.one_of(
    st.sampled_from(JSON_SPECIAL),
    json_values.map(json.dumps),
    json_values.map(json.dumps).map(lambda s: s[: len(s) // 2]),  # a fragment
)


@st.composite
def urls(draw, world):
    fixed = [
        world["root"],
        f"file://{world['root']}",
        os.path.join(world["root"], "r"),
        os.path.join(world["tmp"], "no", "such", "dir"),
        os.path.join(world["tmp"], "catalog.db"),  # a file, not a directory
        "relative/dir",
    ]
    if draw(st.booleans()):
        return draw(st.sampled_from(fixed))
    path = draw(st.one_of(st.sampled_from(["x", "r", "b/x"]), st.text(max_size=12)))
    return draw(st.sampled_from(URL_PREFIXES)) + path


COMMON = ["--json", "--catalog", "--storage-options"]
OPTIONS = {
    "runs": ["--wide"],
    "checkpoints": ["--state", "--all", "--wide"],
    "latest": ["--save-dir"],
    "verify": ["--save-dir", "--step", "--deep", "--wide"],
    "gc": ["--run", "--dry-run", "--grace", "--pending-grace", "--corrupt", "--lease"],
    "sync": ["--inference-name"],
    "pin": [],
    "unpin": [],
    "db": [],
    "export": ["--out", "--step", "--save-dir", "--key", "--source", "--max-shard-size"],
}
ALL_OPTIONS = sorted({*COMMON, *(o for names in OPTIONS.values() for o in names), "--bogus", "-x"})


def mostly(usual: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """``usual`` most of the time, so that most argument lists get past the parser."""
    return st.integers(0, 9).flatmap(lambda n: hostile if n >= 7 else usual)


runs = mostly(st.sampled_from(["r", "never-seen", "imported"]), texts)
steps = mostly(st.sampled_from(["10", "20", "30", "99"]), numbers)


def values(world) -> dict[str, st.SearchStrategy]:
    return {
        "--step": steps,
        "--state": st.sampled_from(STATES),
        "--save-dir": urls(world),
        "--source": urls(world),
        "--grace": mostly(st.sampled_from(DURATIONS), texts | numbers),
        "--pending-grace": mostly(st.sampled_from(DURATIONS), texts | numbers),
        "--lease": mostly(st.sampled_from(DURATIONS), texts | numbers),
        "--run": runs,
        "--inference-name": runs,
        "--storage-options": json_texts,
        "--catalog": mostly(st.just(world["catalog"]), st.sampled_from(CATALOGS)),
        "--out": st.sampled_from(
            [os.path.join(world["tmp"], "out"), world["root"], "out", "/proc/nope/out"]
        ),
        "--key": mostly(st.just("model"), texts),
        "--max-shard-size": mostly(st.sampled_from(SIZES), numbers | texts),
    }


@st.composite
def argvs(draw, world):
    command = draw(mostly(st.sampled_from(COMMANDS), texts))
    positionals = {
        "checkpoints": [runs],
        "latest": [runs],
        "verify": [runs],
        "export": [runs],
        "sync": [urls(world)],
        "pin": [runs, steps],
        "unpin": [runs, steps],
        "db": [st.sampled_from(["upgrade", "current", "downgrade"])],
    }.get(command, [])
    argv = [command]
    for strategy in positionals:
        if draw(st.integers(0, 9)):  # now and then one is missing
            argv.append(draw(strategy))
    strategies = values(world)
    if command == "export" and draw(st.integers(0, 9)):
        argv.extend(["--out", draw(strategies["--out"])])  # required
    known = [*OPTIONS.get(command, []), *COMMON]
    for _ in range(draw(st.integers(0, 3))):
        name = draw(mostly(st.sampled_from(known), st.sampled_from(ALL_OPTIONS)))
        if name not in strategies:
            argv.append(name)
            continue
        value = draw(strategies[name])
        # "--x=VALUE" also passes a value that starts with "-"
        argv.extend([f"{name}={value}"] if draw(st.booleans()) else [name, value])
    return argv


@pytest.mark.timeout(300)
def test_no_argument_list_makes_zephon_exit_70_or_raise(world, capsys):
    @FUZZ
    @given(st.data())
    def check(data):
        argv = data.draw(argvs(world), label="argv")
        run_zephon(argv, capsys)

    check()


# -- commit markers --------------------------------------------------------------------------

HOSTILE_VALUES = [
    None,
    True,
    -1,
    0,
    1.5,
    10**20,
    2**63,
    2**64,
    "",
    "x",
    "../../etc/passwd",
    "/abs",
    "a\\b",
    "_COMMIT",
    "\x00",
    "[/]",
    [],
    {},
    [1, 2],
    {"a": 1},
    "A" * 10_000,
]


def mutate(manifest: dict, data) -> dict:
    """A valid manifest with a few fields (its own, or a file entry's) set to hostile values,
    removed, or duplicated."""
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        target = manifest
        if manifest.get("files") and data.draw(st.booleans(), label="in a file entry"):
            files = manifest["files"]
            if isinstance(files, list) and files and isinstance(files[0], dict):
                target = files[data.draw(st.integers(0, len(files) - 1))]
        keys = sorted(target) or ["x"]
        key = data.draw(st.sampled_from(keys) | st.text(max_size=6), label="key")
        action = data.draw(st.sampled_from(["set", "delete", "duplicate files"]), label="action")
        if action == "delete":
            target.pop(key, None)
        elif action == "duplicate files" and isinstance(manifest.get("files"), list):
            manifest["files"] = manifest["files"] * 2
        else:
            target[key] = data.draw(st.sampled_from(HOSTILE_VALUES) | json_values, label="value")
    return manifest


def mutate_bytes(raw: bytes, data) -> bytes:
    """The valid marker's bytes with a few flipped, cut or inserted."""
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="byte edits")):
        at = data.draw(st.integers(0, max(0, len(out) - 1)), label="at")
        edit = data.draw(st.sampled_from(["flip", "cut", "insert"]), label="edit")
        if edit == "flip" and out:
            out[at] ^= data.draw(st.integers(1, 255))
        elif edit == "cut":
            del out[at : at + data.draw(st.integers(1, 40))]
        else:
            out[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    return bytes(out)


@pytest.mark.timeout(300)
def test_no_commit_marker_makes_zephon_exit_70_or_raise(world, capsys):
    """Each example is the marker of a new step the catalog has not seen, beside a copy of a
    real save's files, so that every command reads it: sync and gc index it, latest scans it,
    verify checks it."""
    root = world["root"]
    with open(os.path.join(root, "r", "save-20", MARKER_NAME), "rb") as handle:
        valid = json.loads(handle.read())
    payload = os.path.join(root, "r", "save-20", valid["payload"])
    steps = itertools.count(100_000)  # same width: the same draws replay the same edits

    @settings(FUZZ, max_examples=60)
    @given(st.data())
    def check(data):
        step = next(steps)
        step_dir = os.path.join(root, "r", f"save-{step}")
        shutil.copytree(payload, os.path.join(step_dir, valid["payload"]))
        manifest = {**copy.deepcopy(valid), "step": step}
        kind = data.draw(st.sampled_from(["mutated json", "mutated bytes", "bytes"]), label="kind")
        if kind == "bytes":
            content = data.draw(st.binary(max_size=400), label="marker")
        elif kind == "mutated bytes":
            content = mutate_bytes(json.dumps(manifest).encode(), data)
        else:
            content = json.dumps(mutate(manifest, data)).encode()
        with open(os.path.join(step_dir, MARKER_NAME), "wb") as handle:
            handle.write(content)
        for argv in (
            ["sync", root],
            ["latest", "r"],
            ["latest", "r", "--save-dir", root],
            ["verify", "r", "--step", str(step), "--deep"],
            ["checkpoints", "r", "--all"],
            ["gc"],
        ):
            code, _, _ = run_zephon(argv, capsys)
            assert code in (0, 1, 3, 4), (argv, code, content[:200])

    check()
