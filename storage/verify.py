"""Checking a committed checkpoint against its manifest: shallow (every file exists with its
size, one listing) or deep (every file's CRC32C, by reading it)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from zephon.storage.backend import list_files, read_ranges
from zephon.storage.checksum import Crc32c, decode_crc32c
from zephon.storage.errors import CorruptCheckpointError
from zephon.storage.location import Location
from zephon.storage.manifest import FileEntry, Manifest
from zephon.storage.redact import redact

__all__ = ["FileProblem", "VerifyReport", "verify_checkpoint"]

_READ_CHUNK = 32 << 20


@dataclass(frozen=True, slots=True)
class FileProblem:
    name: str
    kind: str  # "missing" | "size" | "checksum" | "unreadable"
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


@dataclass(slots=True)
class VerifyReport:
    """The outcome of verifying one checkpoint; ``problems`` names every bad file."""

    url: str
    run: str | None
    step: int
    deep: bool
    files_checked: int = 0
    bytes_checked: int = 0
    problems: list[FileProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        """Raise ``CorruptCheckpointError`` naming every bad file, if there is any."""
        if self.ok:
            return
        names = "; ".join(str(p) for p in self.problems[:20])
        more = f" (and {len(self.problems) - 20} more)" if len(self.problems) > 20 else ""
        raise CorruptCheckpointError(
            f"checkpoint {self.url} failed verification: {names}{more}; it cannot be resumed "
            "from: delete it and resume from an earlier checkpoint",
            url=self.url,
            run=self.run,
            step=self.step,
            problems=[str(p) for p in self.problems],
        )


def _crc_of_file(location: Location, path: str, size: int) -> tuple[int, str]:
    running = Crc32c()
    for piece in read_ranges(location, path, size, _READ_CHUNK):
        running.update(piece)
    return running.size, running.encoded()


def _chunk_problem(entry: FileEntry, listed: dict[str, int]) -> FileProblem | None:
    """The problem of a deduplicated file whose chunks are not all there with their sizes."""
    for chunk in entry.chunks or ():
        size = listed.get(chunk.name)
        if size is None:
            return FileProblem(entry.name, "missing", f"chunk {chunk.name} is missing")
        if size != chunk.size:
            return FileProblem(
                entry.name, "size", f"chunk {chunk.name} holds {size} bytes, not {chunk.size}"
            )
    return None


def _crc_of_chunks(location: Location, chunk_dir: str | None, entry: FileEntry) -> tuple[int, str]:
    """The size and CRC32C of a deduplicated file, read chunk by chunk; a chunk that does not
    match its own reference raises (reported as unreadable, naming it)."""
    total = Crc32c()
    for chunk in entry.chunks or ():
        size, crc = _crc_of_file(location, f"{chunk_dir}/{chunk.name}", chunk.size)
        if size != chunk.size or crc != chunk.crc32c:
            raise ValueError(
                f"chunk {chunk.name} has crc32c {crc}, its reference says {chunk.crc32c}"
            )
        total.extend(decode_crc32c(crc), size)
    return total.size, total.encoded()


def verify_checkpoint(
    location: Location,
    path: str,
    manifest: Manifest,
    *,
    url: str,
    deep: bool,
    executor_factory: Callable[[], Executor],
    chunk_dir: str | None = None,
) -> VerifyReport:
    """``path``: the payload directory; ``chunk_dir``: the run's chunk directory, where the
    chunks of a deduplicated file are (each checked as its file's part: present with its
    size, and deep, its CRC32C)."""
    report = VerifyReport(url=url, run=manifest.run, step=manifest.step, deep=deep)
    plain = [e for e in manifest.files if e.chunks is None]
    listed = {f.path: f.size for f in list_files(location, path)} if plain else {}
    chunked = [e for e in manifest.files if e.chunks is not None]
    chunks_listed: dict[str, int] = {}
    if chunked and chunk_dir is not None:
        chunks_listed = {f.path.rsplit("/", 1)[-1]: f.size for f in list_files(location, chunk_dir)}
    prefix = f"{path}/"
    present = []
    for entry in manifest.files:
        if entry.chunks is not None:
            problem = _chunk_problem(entry, chunks_listed)
            if problem is None:
                present.append(entry)
            else:
                report.problems.append(problem)
            continue
        size = listed.get(prefix + entry.name)
        if size is None:
            report.problems.append(FileProblem(entry.name, "missing", "missing"))
        elif size != entry.size:
            report.problems.append(
                FileProblem(entry.name, "size", f"size {size} bytes, manifest says {entry.size}")
            )
        else:
            present.append(entry)
    report.files_checked = len(manifest.files)
    if not deep:
        report.bytes_checked = sum(e.size for e in present)
        return report
    pool = executor_factory()
    futures = {
        e.name: (
            e,
            pool.submit(_crc_of_chunks, location, chunk_dir, e)
            if e.chunks is not None
            else pool.submit(_crc_of_file, location, prefix + e.name, e.size),
        )
        for e in present
    }
    for name, (entry, future) in futures.items():
        try:
            size, crc = future.result()
        except Exception as exc:  # a file that cannot be read is a finding, not a crash
            detail = f"unreadable: {redact(str(exc), location.secrets)}"
            report.problems.append(FileProblem(name, "unreadable", detail))
            continue
        report.bytes_checked += size
        if crc != entry.crc32c or size != entry.size:
            report.problems.append(
                FileProblem(name, "checksum", f"crc32c {crc}, manifest says {entry.crc32c}")
            )
    report.problems.sort(key=lambda p: p.name)
    return report
