"""``zephon adopt``: a stock DCP checkpoint (torch's ``FileSystemWriter``/``FsspecWriter``)
becomes a checkpoint of a Zephon run, which ``zephon.dcp.Reader`` then loads.

One stock checkpoint is a directory with a pickled ``.metadata`` and ``__<rank>_<n>.distcp``
files; a directory of ``step-<N>`` checkpoints (torchtitan's layout) is adopted in one call,
in step order. For each step:

1. the source's ``.metadata`` is read by the allowlist unpickler
   (``zephon.dcp.stock_loader``) and checked, before anything is written;
2. the step is saved through the one save path (``zephon.saving.Save`` by way of the run
   session's destination, as ``zephon.dcp.Writer``'s saves are): the job's attempt is
   registered at the first step (continuing the run's latest checkpoint, so a step below it is
   refused as ``SaveBelowLatestError``), the catalog row armed ``pending``, storage ``begin``;
3. every shard file is copied into the save under its own name and read once: on the server
   when source and run are on one object store (``CheckpointWriter.copy_from``: the copy is
   what is read), else streamed from the source into the save; each tensor blob's header is
   read by the allowlist unpickler to find where the tensor's bytes are, and their CRC32C
   computed on the way; a refusal fails the save (its files removed, its row ``failed``);
4. Zephon's JSON metadata (``dcp_metadata.json``) points each tensor at its raw bytes inside
   its blob, and each non-tensor item at its bytes; torch's own ``.metadata`` is written anew
   from what the allowlist loader rebuilt (so stock readers still load the adopted checkpoint,
   as they load every Zephon save); the marker is committed, then the row.

A step the run already holds (its marker exists) is skipped and reported, so an adoption that
stopped part-way is finished by running it again. The source's ``.metadata`` is never copied
byte for byte: the one written is pickled here from allowlisted objects only, and Zephon's own
reader never reads it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

from zephon.catalog import Catalog
from zephon.dcp.addressing import check_step, parse_run_url
from zephon.dcp.errors import StockCheckpointError
from zephon.dcp.metadata_codec import ShardSlice, decode_metadata, dtype_name, encode_metadata
from zephon.dcp.stock_format import STOCK_METADATA_FILE, stock_metadata
from zephon.dcp.stock_loader import StockItem, read_stock_metadata, tensor_span
from zephon.dcp.writer import METADATA_FILE
from zephon.errors import ConfigError, SaveBelowLatestError
from zephon.locations import RunLocation
from zephon.session import RunSession
from zephon.storage import (
    CheckpointStore,
    CheckpointWriter,
    Location,
    crc32c_extend,
    encode_crc32c,
    list_files,
    open_location,
    open_read,
    parse_step_dirname,
    read_file,
)

__all__ = ["AdoptReport", "AdoptedStep", "adopt"]

#: torchtitan's name of a step's checkpoint directory
_STEP_DIR = "step-"
#: gaps between items (none in torch's files) are copied in pieces of this size
_CHUNK = 8 << 20
#: the DCP metadata version torch's FileSystemWriter writes
_DCP_VERSION = "1.0.0"
#: shard files copied at once (each holds about one item in memory while it is read)
_COPY_THREADS = 4

T = TypeVar("T")


@dataclass(frozen=True)
class AdoptedStep:
    """One step of the run adopted from ``source``: ``files`` shard files, ``bytes`` bytes,
    ``items`` items; ``skipped`` says why it was not (it is in the run already)."""

    step: int
    source: str
    url: str
    files: int = 0
    bytes: int = 0
    items: int = 0
    #: how many of the files the store copied on the server (source and run on one store)
    copied_on_server: int = 0
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "source": self.source,
            "url": self.url,
            "files": self.files,
            "bytes": self.bytes,
            "items": self.items,
            "copied_on_server": self.copied_on_server,
            "skipped": self.skipped,
        }


@dataclass
class AdoptReport:
    """What ``adopt`` did, step by step in step order."""

    run: str
    steps: list[AdoptedStep] = field(default_factory=list)

    @property
    def adopted(self) -> list[int]:
        return [s.step for s in self.steps if s.skipped is None]

    @property
    def skipped(self) -> list[int]:
        return [s.step for s in self.steps if s.skipped is not None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "adopted": self.adopted,
            "skipped": self.skipped,
            "steps": [s.to_dict() for s in self.steps],
        }


def adopt(
    source: str | os.PathLike,
    run_url: str | os.PathLike,
    *,
    step: int | None = None,
    catalog: Catalog | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    source_options: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> AdoptReport:
    """Adopt the stock DCP checkpoint at ``source`` as step ``step`` of the run at
    ``run_url`` (``<save_dir>/<run>``), or, when ``source`` holds ``step-<N>`` checkpoint
    directories instead (torchtitan's layout; ``step`` not given), each of them as step N, in
    step order. ``catalog`` (a ``catalog.Catalog`` or its URL; default ``$ZEPHON_CATALOG_URL``,
    else none) records each step's row as any save does. ``storage_options`` are the run's
    fsspec options, ``source_options`` the source's (default: the run's when both URLs have
    the same protocol, else none).

    Steps the run already holds are skipped (``AdoptReport.skipped``). Raises
    ``StockCheckpointError`` for a source that is not a stock checkpoint Zephon can adopt
    (naming the file and the fix), ``ConfigError`` for bad arguments, and whatever the save
    path raises (``SaveBelowLatestError`` for a step below the run's latest, storage and
    catalog errors)."""
    target = parse_run_url(run_url, "adopt")
    step = check_step(step, "adopt")
    given_source = os.fspath(source) if isinstance(source, os.PathLike) else source
    options = source_options
    if options is None and _protocol(given_source) == _protocol(target.root):
        options = storage_options  # one store for both, e.g. the same S3 endpoint
    src = open_location(given_source, options)
    found = _stock_checkpoints(src, step)
    say = progress or (lambda _line: None)
    store = CheckpointStore(target.root, storage_options)
    location = RunLocation(target.run, store, target.run)
    report = AdoptReport(target.run)
    session = RunSession(location, catalog=catalog, retention=None)
    try:
        destination = session.open_destination()
        present = set(location.runstore.committed_steps())
        for number, directory, files in found:
            url = location.checkpoint_url(number)
            where = src.display(directory)
            if number in present:
                report.steps.append(
                    AdoptedStep(number, where, url, skipped="the run holds this step already")
                )
                say(f"step {number}: in the run already, skipped")
                continue
            say(f"step {number}: adopting {where}")
            try:
                done = _adopt_step(src, directory, files, number, session, destination)
            except SaveBelowLatestError as exc:
                raise SaveBelowLatestError(
                    f"run {target.run}: refusing to adopt step {number} below its latest "
                    f"checkpoint {exc.latest}: adopt it into another run (a new run URL), or "
                    f"only steps above {exc.latest}",
                    run=exc.run,
                    step=number,
                    latest=exc.latest,
                ) from None
            report.steps.append(done)
        return report
    finally:
        session.close()
        store.close()


def _stock_checkpoints(src: Location, step: int | None) -> list[tuple[int, str, dict[str, int]]]:
    """``(step, directory, {file name: size})`` of every checkpoint to adopt, in step order,
    from one listing of the source."""
    root = src.root.rstrip("/")
    listed: dict[str, int] = {}
    for entry in list_files(src, root):
        if entry.path.startswith(f"{root}/"):
            listed[entry.path[len(root) + 1 :]] = entry.size
    if STOCK_METADATA_FILE in listed:
        if step is None:
            raise ConfigError(
                f"{src.url} is one stock checkpoint: give the step to adopt it as (--step N)"
            )
        files = {name: size for name, size in listed.items() if "/" not in name}
        return [(step, root, files)]
    steps: dict[int, dict[str, int]] = {}
    for name, size in listed.items():
        top, _, rest = name.partition("/")
        number = _step_of(top)
        if number is not None and rest and "/" not in rest:
            steps.setdefault(number, {})[rest] = size
    found = sorted((n, f"{root}/{_STEP_DIR}{n}", files) for n, files in steps.items())
    found = [(n, d, files) for n, d, files in found if STOCK_METADATA_FILE in files]
    if not found:
        raise StockCheckpointError(
            f"{src.url} holds no {STOCK_METADATA_FILE} and no {_STEP_DIR}<N> directory with "
            "one: it is not a stock DCP checkpoint; give the directory torch's FileSystemWriter "
            f"wrote, or a directory of {_STEP_DIR}<N> ones",
            path=src.url,
        )
    if step is not None:
        raise ConfigError(
            f"{src.url} holds {_STEP_DIR}<N> checkpoints, whose steps are their names: leave "
            f"out --step, or give one {_STEP_DIR}<N> directory with --step"
        )
    return found


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _step_of(name: str) -> int | None:
    if not name.startswith(_STEP_DIR):
        return None
    return parse_step_dirname(f"save-{name[len(_STEP_DIR) :]}")


def _adopt_step(
    src: Location,
    directory: str,
    files: dict[str, int],
    step: int,
    session: RunSession,
    destination: Any,
) -> AdoptedStep:
    """Adopt one stock checkpoint as ``step`` through the save path (module docstring)."""
    where = src.display(directory)
    stock = read_stock_metadata(
        read_file(src, f"{directory}/{STOCK_METADATA_FILE}"), where=f"{where}/{STOCK_METADATA_FILE}"
    )
    by_file = stock.by_file()
    for name, items in by_file.items():
        _check_extent(name, items, files, where)
    started = time.monotonic()
    save = destination.begin(session.attempt_for_save(), step)
    writer = save.writer
    try:
        slices: dict[MetadataIndex, ShardSlice] = {}
        on_server = 0
        for placed, copied in _each_file(
            lambda name: _copy_file(
                src, f"{directory}/{name}", files[name], name, by_file[name], writer, where
            ),
            list(by_file),
        ):
            slices.update(placed)
            on_server += copied
        metadata = Metadata(
            state_dict_metadata=stock.metadata.state_dict_metadata,
            planner_data=stock.metadata.planner_data,
            storage_data=slices,
            storage_meta=StorageMeta(checkpoint_id=writer.url, save_id=writer.save_id),
            version=stock.metadata.version or _DCP_VERSION,
        )
        encoded = encode_metadata(metadata)
        decode_metadata(encoded, where=f"{writer.url}/{METADATA_FILE}")  # loadable, or refused
        stock_storage = {
            item.index: _StorageInfo(item.file, item.offset, item.length) for item in stock.items
        }
        ranks = {name.split("_")[2] for name in by_file if name.count("_") >= 3}
        # The two metadata files go out with the commit's payload listing and fence re-check,
        # then the marker, which carries a copy of the DCP metadata as a DCP save's does
        # (docs/fencing.md, the commit rule): two round trips fewer than writing them first.
        save.commit(
            {
                "dcp": {
                    "format_version": 2,
                    "metadata": METADATA_FILE,
                    "stock_metadata": STOCK_METADATA_FILE,
                    "ranks": max(1, len(ranks)),
                    "shard_files": len(by_file),
                },
                "adopted_from": where,
            },
            files={
                METADATA_FILE: encoded,
                STOCK_METADATA_FILE: stock_metadata(metadata, stock_storage),
            },
            inline=[METADATA_FILE],
        )
    except BaseException as exc:
        destination.failed(save, exc)
        raise
    destination.committed(save, {}, started)
    return AdoptedStep(
        step,
        where,
        writer.url,
        files=len(by_file),
        bytes=sum(files[name] for name in by_file),
        items=len(stock.items),
        copied_on_server=on_server,
    )


def _each_file(copy: Callable[[str], T], names: list[str]) -> list[T]:
    """``copy(name)`` of every file, ``_COPY_THREADS`` at a time; the first failure is raised
    once the copies under way have finished, and no new copy starts after it."""
    failed = threading.Event()

    def one(name: str) -> T:
        if failed.is_set():
            raise _NotStarted(name)
        try:
            return copy(name)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(max(1, min(_COPY_THREADS, len(names)))) as pool:
        futures = [pool.submit(one, name) for name in names]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None and not isinstance(e, _NotStarted)), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]


class _NotStarted(Exception):
    """A copy not started because another one failed first."""


def _check_extent(name: str, items: list[StockItem], files: dict[str, int], where: str) -> None:
    """Refuse, before anything is written, a shard file that is missing or shorter than its
    items reach (a truncated copy), or items that overlap."""
    if name not in files:
        raise StockCheckpointError(
            f"{where}/{name} is missing, but {STOCK_METADATA_FILE} places items in it: adopt a "
            "complete copy of the checkpoint",
            path=f"{where}/{name}",
        )
    end = 0
    for item in items:
        if item.offset < end:
            raise StockCheckpointError(
                f"{where}/{STOCK_METADATA_FILE}: item {item.index.fqn!r} overlaps the item "
                f"before it in {name}: the metadata is damaged; adopt an intact copy",
                path=f"{where}/{STOCK_METADATA_FILE}",
            )
        end = item.offset + item.length
    if end > files[name]:
        raise StockCheckpointError(
            f"{where}/{name} has {files[name]} bytes, but its items reach byte {end}: the file "
            "is truncated; adopt a complete copy of the checkpoint",
            path=f"{where}/{name}",
        )


def _copy_file(
    src: Location,
    path: str,
    size: int,
    name: str,
    items: list[StockItem],
    writer: CheckpointWriter,
    where: str,
) -> tuple[dict[MetadataIndex, ShardSlice], bool]:
    """Copy one shard file into ``writer`` as it is, reading it once; returns each item's
    slice (tensor items: their raw bytes inside the blob, with their CRC32C) and whether the
    store copied it on the server (source and run on one object store: the bytes read are the
    copy's, so every CRC32C is of what the run holds)."""
    shown = f"{where}/{name}"
    if writer.can_copy_from(src):
        slices: dict[MetadataIndex, ShardSlice] = {}
        writer.copy_from(
            src, path, name, size, read=lambda copy: slices.update(_place(copy, items, name, shown))
        )
        return slices, True
    with open_read(src, path, size) as source, writer.open(name) as out:
        slices = _place(source, items, name, shown, out)
        end = items[-1].offset + items[-1].length if items else 0
        _copy_gap(source, out.write, size - end, shown)  # anything after the last item
    return slices, False


def _place(
    source: IO[bytes], items: list[StockItem], name: str, shown: str, out: Any = None
) -> dict[MetadataIndex, ShardSlice]:
    """Read a shard file from its start, finding each item's slice; with ``out``, write every
    byte read into it (each item's CRC32C combined into the file's, not computed twice)."""
    write = out.write if out is not None else (lambda _data, crc=None: None)
    slices: dict[MetadataIndex, ShardSlice] = {}
    position = 0
    for item in items:
        _copy_gap(source, write, item.offset - position, shown)
        blob = memoryview(_read_exact(source, item.length, shown))
        if item.is_tensor:
            start, length = tensor_span(blob, item, where=shown)
            raw = blob[start : start + length]
            crc = crc32c_extend(0, raw)
            write(blob[:start])
            write(raw, crc=crc)
            write(blob[start + length :])
            slices[item.index] = ShardSlice(
                name,
                item.offset + start,
                length,
                "raw",
                dtype_name(item.dtype),
                item.shape,
                crc32c=encode_crc32c(crc),
            )
        else:
            crc = crc32c_extend(0, blob)
            write(blob, crc=crc)
            slices[item.index] = ShardSlice(
                name, item.offset, item.length, "bytes", crc32c=encode_crc32c(crc)
            )
        position = item.offset + item.length
    return slices


def _copy_gap(source: IO[bytes], write: Any, length: int, shown: str) -> None:
    while length > 0:
        piece = _read_exact(source, min(length, _CHUNK), shown)
        write(piece)
        length -= len(piece)


def _read_exact(source: IO[bytes], length: int, shown: str) -> bytes:
    data = source.read(length)
    while len(data) < length:
        more = source.read(length - len(data))
        if not more:
            raise StockCheckpointError(
                f"{shown} ended {length - len(data)} bytes early while it was copied: it is "
                "truncated or was changed during the adoption; adopt a complete copy",
                path=shown,
            )
        data += more
    return data
