"""Where a drop-in ``zephon.dcp.Writer`` or ``Reader`` points: its run URL
(``<save_dir>/<run>``), its step, and the step a DCP ``checkpoint_id`` names, each checked with
a one-line ``ConfigError`` (credentials masked) naming the argument and the fix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from zephon.dcp.errors import WriterSetupError
from zephon.errors import ConfigError
from zephon.storage import (
    CheckpointStore,
    mask_url,
    parse_step_dirname,
    validate_run,
    validate_step,
)

__all__ = ["RunURL", "check_step", "parse_run_url", "step_of_checkpoint_id"]


@dataclass(frozen=True, slots=True)
class RunURL:
    """``<save_dir>/<run>`` split: the store's root as given, and the run name."""

    given: str
    root: str
    run: str


def parse_run_url(url: str | os.PathLike, what: str) -> RunURL:
    """Split a Writer's or Reader's ``url`` into its save_dir and run (the last component);
    a one-line ``ConfigError`` naming the URL (credentials masked) and the fix otherwise."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(
            f"{what} url = {url!r} is invalid: give the run's URL, <save_dir>/<run>, e.g. "
            "'s3://bucket/ckpt/my-run' or '/data/ckpt/my-run'"
        )
    given = url.rstrip("/")
    root, sep, run = given.rpartition("/")
    if not sep or not root or root.endswith(":/") or root.endswith(":"):
        raise ConfigError(
            f"{what} url {mask_url(url)!r} has no run component: give <save_dir>/<run>, e.g. "
            f"'{mask_url(given)}/my-run'"
        )
    try:
        validate_run(run)
    except ValueError:
        raise ConfigError(
            f"{what} url {mask_url(url)!r}: its last component {run[:60]!r} is not a valid run "
            "name (1-128 of A-Z a-z 0-9 . _ -, not a step directory like 'save-5'): give "
            "<save_dir>/<run>"
        ) from None
    return RunURL(given, root, run)


def check_step(step: Any, what: str, name: str = "step") -> int | None:
    """``step`` as given to a Writer or Reader (its argument ``name``): None, or a step
    number."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError(f"{what} {name} = {step!r} is invalid: give an integer >= 0, or None")
    try:
        return validate_step(step)
    except ValueError as exc:
        raise ConfigError(f"{what} {name} = {step!r} is invalid: {exc}") from None


def step_of_checkpoint_id(
    checkpoint_id: str | os.PathLike, url: RunURL, store: CheckpointStore, what: str
) -> int:
    """The step a ``checkpoint_id`` names: ``<run url>/save-<step>`` (also in the store's own
    path form). Anything else is refused, naming what this object is bound to."""
    given = os.fspath(checkpoint_id).rstrip("/") if checkpoint_id is not None else ""
    parent, _, last = given.rpartition("/")
    step = parse_step_dirname(last)
    run_forms = {
        url.given,
        store.run(url.run).run_path().rstrip("/"),
        store.location.display(store.run(url.run).run_path()).rstrip("/"),
    }
    if step is None or parent not in run_forms:
        shown = mask_url(given) if "://" in given else given
        raise WriterSetupError(
            f"checkpoint_id {shown!r} is not a checkpoint of this {what}'s run "
            f"{mask_url(url.given)}: pass checkpoint_id='{mask_url(url.given)}/save-<step>', or "
            f"make a {what} for the other run"
        )
    return step
