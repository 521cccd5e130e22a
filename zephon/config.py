"""Job configuration for checkpointing (docs/manager.md), validated on construction.

``load_job_config`` reads a job YAML file of this shape::

    run: {name: my-run}
    trainer:
      total_steps: 1000
      checkpointing:
        save_dir: s3://bucket/checkpoints
        period_steps: 100            # int >= 1 | "last_step" | "disable" | "auto"
        auto_period: {min_steps: 10, max_steps: 10000, mtbf_s: 86400}  # with "auto"
        metrics: {prometheus_port: 9400, textfile: /var/lib/node_exporter/zephon.prom}
        num_to_keep: 2               # int >= 1 | null
        local_dir: /local_nvme/ckpt  # optional fast local tier, uploaded in the background
        memory_tier: false           # or true: host memory first, a peer copy, then save_dir
        retry: {max_attempts: 30, deadline_s: 120}  # transient storage failures (optional)
        catalog_outage_s: 300        # the job fails once the catalog is unreachable this long
        emergency_save: {signals: [SIGTERM], grace_s: 30, when: step}  # save on preemption
    model_stage_factory:
      checkpoint_only_trainable_parameters: false
      source_checkpoint: null

Every invalid value raises ``ConfigError`` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from zephon.emergency import EmergencySaveConfig
from zephon.errors import ConfigError, invalid_option
from zephon.retention import Retention
from zephon.storage import DEFAULT_RETRY, MAX_STEP, InvalidArgumentError, RetryPolicy

if TYPE_CHECKING:
    from zephon.destinations.local.config import TierConfig

__all__ = [
    "CheckpointingConfig",
    "JobConfig",
    "ModelStageConfig",
    "load_job_config",
    "retry_policy_from",
]

PERIOD_WORDS = ("last_step", "disable", "auto")
ON_CORRUPT = ("fallback", "fail")


_fail = invalid_option


#: how long the catalog may stay unreachable before a job fails (``catalog_outage_s``)
DEFAULT_CATALOG_OUTAGE_S = 300.0
#: the smallest ``catalog_outage_s`` a job may set
MIN_CATALOG_OUTAGE_S = 1.0
#: the largest: a day (a longer outage is an abandoned catalog, not a blip)
MAX_CATALOG_OUTAGE_S = 86400.0


def _positive_int(value: Any, most: int = MAX_STEP) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most


def _masked_repr(config: Any, urls: tuple[str, ...]) -> str:
    """The dataclass repr with credentials masked: configs get logged and printed whole, and
    their URLs may carry passwords and their storage_options keys, secrets and tokens."""
    from zephon.storage import mask_url, redact_options

    shown = []
    for item in fields(config):
        value = getattr(config, item.name)
        if item.name == "storage_options":
            value = redact_options(value)
        elif item.name in urls and isinstance(value, str):
            value = mask_url(value)
        shown.append(f"{item.name}={value!r}")
    return f"{type(config).__name__}({', '.join(shown)})"


_RETRY_KEYS = tuple(item.name for item in fields(RetryPolicy))


def retry_policy_from(value: Any, key: str) -> RetryPolicy:
    """A ``RetryPolicy`` from itself or a mapping of its fields (YAML ``retry:``,
    ``$ZEPHON_RETRY``); ``ConfigError`` naming ``key`` for anything else."""
    if isinstance(value, RetryPolicy):
        return value
    if not isinstance(value, Mapping):
        raise _fail(key, value, f"use a mapping of {', '.join(_RETRY_KEYS)}")
    unknown = sorted(set(value) - set(_RETRY_KEYS))
    if unknown:
        raise ConfigError(
            f"{key}.{unknown[0]} is not a known setting; known: {', '.join(_RETRY_KEYS)}"
        )
    try:
        return RetryPolicy(**dict(value))
    except InvalidArgumentError as exc:
        raise ConfigError(f"{key} is invalid: {exc}") from None


def _tier_config(**options: Any) -> TierConfig:
    """The local tier's ``TierConfig``; imported here, not with this module, since importing
    ``zephon.destinations`` loads the storage layer (``zephon --help`` need not)."""
    from zephon.destinations.local.config import TierConfig

    return TierConfig(**options)


@dataclass(kw_only=True, slots=True, repr=False)
class CheckpointingConfig:
    """``trainer.checkpointing``: where and how often a job saves, and how many it keeps."""

    save_dir: str
    period_steps: int | str = "last_step"
    num_to_keep: int | None = None
    #: also keep every checkpoint whose step is a multiple of this (milestones)
    keep_every_steps: int | None = None
    #: None: $ZEPHON_CATALOG_URL if set, else no catalog (the storage scan finds checkpoints)
    catalog_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    #: return from save() once state is staged in host memory; write in the background
    async_save: bool = False
    #: check every byte loaded against its CRC32C, while reading (no second pass)
    verify_on_load: bool = True
    #: a checkpoint that fails verification on load: "fallback" quarantines it and loads the
    #: next complete one; "fail" raises
    on_corrupt: str = "fallback"
    #: a node-local directory (a plain path) for a fast local tier: save() commits there and
    #: returns, a background uploader copies each checkpoint to save_dir (docs/manager.md)
    local_dir: str | None = None
    #: local checkpoints kept beyond those still waiting for their upload
    local_num_to_keep: int = 1
    #: save() waits while this many uploads to save_dir are pending (backpressure)
    max_pending_uploads: int = 2
    #: save() commits into host memory (``memory_dir``, a RAM disk on every node), each node's
    #: part is copied to ``memory_replicas`` peer nodes, and uploaded to save_dir in the
    #: background; a restart resumes from the fastest verified copy (docs/tiers.md)
    memory_tier: bool = False
    #: the memory tier's directory on every node (default /dev/shm/zephon)
    memory_dir: str | None = None
    #: memory checkpoints kept per node beyond those still waiting for their upload
    memory_num_to_keep: int = 1
    #: peer nodes holding a copy of each node's memory checkpoint
    memory_replicas: int = 1
    #: store each save's tensors as content-addressed chunks under the run, uploading only the
    #: chunks the previous checkpoint does not hold already (docs/dedup.md)
    dedup: bool = False
    #: where deduplicated chunks go: "run" (``<run>/_chunks/``) or "save_dir" (shared by every
    #: run under save_dir; a run's first save can then reuse its source_checkpoint's chunks)
    dedup_scope: str = "run"
    #: how transient storage failures (5xx, throttling, timeouts, broken connections) are
    #: tried again, for every store the job opens; YAML: a mapping of ``RetryPolicy`` fields
    retry: RetryPolicy = DEFAULT_RETRY
    #: seconds the catalog may stay unreachable: saves go on to storage meanwhile and the
    #: catalog is brought up to date once it answers; past this the job fails
    catalog_outage_s: float = DEFAULT_CATALOG_OUTAGE_S
    #: save on preemption (``zephon.emergency``): None (off), or the signals that make every
    #: rank save at the next step boundary and exit; YAML: a mapping of its keys
    emergency_save: EmergencySaveConfig | None = None
    #: with ``period_steps: auto``: the period's bounds and the prior MTBF (docs/goodput.md);
    #: YAML: a mapping of ``AutoPeriod`` fields
    auto_period: Any = None
    #: metrics for scrapers (docs/goodput.md): a mapping of ``prometheus_port`` and
    #: ``textfile``; None: none exported
    metrics: Any = None
    prefix: str = "trainer.checkpointing"

    def __post_init__(self) -> None:
        p = self.prefix
        if not isinstance(self.save_dir, str) or not self.save_dir.strip():
            raise _fail(
                f"{p}.save_dir",
                self.save_dir,
                "use a directory or fsspec URL, e.g. runs/checkpoints or s3://b/ckpt",
            )
        period = self.period_steps
        if not (_positive_int(period) or period in PERIOD_WORDS):
            raise _fail(
                f"{p}.period_steps",
                period,
                f'use an integer from 1 to {MAX_STEP}, "last_step", "disable" or "auto"',
            )
        Retention.checked(f"{p}.", self.num_to_keep, self.keep_every_steps)
        if self.catalog_url is not None and (
            not isinstance(self.catalog_url, str) or "://" not in self.catalog_url
        ):
            raise _fail(
                f"{p}.catalog_url",
                self.catalog_url,
                "use a SQLAlchemy URL such as sqlite:///catalog.db or "
                "postgresql+psycopg://host/db, or leave it unset",
            )
        if not isinstance(self.storage_options, Mapping):
            raise _fail(
                f"{p}.storage_options", self.storage_options, "use a mapping of fsspec options"
            )
        self.storage_options = dict(self.storage_options)
        if self.on_corrupt not in ON_CORRUPT:
            raise _fail(f"{p}.on_corrupt", self.on_corrupt, 'use "fallback" or "fail"')
        outage = self.catalog_outage_s
        if (
            isinstance(outage, bool)
            or not isinstance(outage, int | float)
            or not MIN_CATALOG_OUTAGE_S <= outage <= MAX_CATALOG_OUTAGE_S
        ):
            raise _fail(
                f"{p}.catalog_outage_s",
                outage,
                f"use a number of seconds from {MIN_CATALOG_OUTAGE_S:g} to "
                f"{MAX_CATALOG_OUTAGE_S:g}",
            )
        self.catalog_outage_s = float(outage)
        for key in ("async_save", "verify_on_load", "dedup"):
            if not isinstance(getattr(self, key), bool):
                raise _fail(f"{p}.{key}", getattr(self, key), "use true or false")
        self._check_local_tier()
        if self.dedup_scope not in ("run", "save_dir"):
            raise _fail(f"{p}.dedup_scope", self.dedup_scope, 'use "run" or "save_dir"')
        if (
            self.dedup
            and self.dedup_scope == "save_dir"
            and (self.local_dir is not None or self.memory_tier)
        ):
            raise _fail(
                f"{p}.dedup_scope",
                self.dedup_scope,
                'a tier\'s uploads keep chunks per run in this version: use dedup_scope "run" '
                "with local_dir or memory_tier",
            )
        self.retry = retry_policy_from(self.retry, f"{p}.retry")
        self.emergency_save = EmergencySaveConfig.of(self.emergency_save, f"{p}.emergency_save")
        self._check_goodput_options()

    def _check_goodput_options(self) -> None:
        """``auto_period`` (an ``AutoPeriod``, with ``period_steps: auto`` only) and
        ``metrics`` (a ``MetricsConfig``), checked by their own modules, named under this
        config's prefix. Imported only when set: the period policy's package loads torch."""
        p = self.prefix
        if self.period_steps == "auto" or self.auto_period is not None:
            if self.period_steps != "auto":
                raise _fail(f"{p}.auto_period", self.auto_period, 'set period_steps: "auto" too')
            from zephon.checkpointing.period import AutoPeriod

            self.auto_period = AutoPeriod.checked(self.auto_period, f"{p}.auto_period")
        if self.metrics is not None:
            from zephon.metrics import MetricsConfig

            self.metrics = MetricsConfig.checked(self.metrics, f"{p}.metrics")

    def _check_local_tier(self) -> None:
        """``local_dir``, ``local_num_to_keep`` and ``max_pending_uploads``: the local tier's
        own config (``TierConfig``) checks them, named under this config's prefix."""
        tier = self._tier_options()
        self.local_dir, self.memory_dir = tier.local_dir, tier.memory_dir

    def _tier_options(self) -> TierConfig:
        return _tier_config(
            local_dir=self.local_dir,
            local_num_to_keep=self.local_num_to_keep,
            max_pending_uploads=self.max_pending_uploads,
            save_dir=self.save_dir,
            prefix=self.prefix,
            memory_tier=self.memory_tier,
            memory_dir=self.memory_dir,
            memory_num_to_keep=self.memory_num_to_keep,
            memory_replicas=self.memory_replicas,
            dedup=self.dedup,
        )

    @property
    def tier(self) -> TierConfig | None:
        """The tiers' config, or None without ``local_dir`` or ``memory_tier``."""
        if self.local_dir is None and not self.memory_tier:
            return None
        return self._tier_options()

    @property
    def retention(self) -> Retention:
        """``num_to_keep`` and ``keep_every_steps``, as every entry point takes them."""
        return Retention(self.num_to_keep, self.keep_every_steps)

    @property
    def resolved_catalog_url(self) -> str | None:
        return self.catalog_url or os.environ.get("ZEPHON_CATALOG_URL") or None

    def saves_at(self, step: int, total_steps: int | None) -> bool:
        """Whether a job saves after completing ``step`` (``period_steps`` in docs/manager.md)."""
        if self.period_steps == "disable":
            return False
        is_last = total_steps is not None and step == total_steps
        if self.period_steps in ("last_step", "auto"):  # auto: the manager's PeriodPolicy
            return is_last
        return is_last or step % int(self.period_steps) == 0

    def __repr__(self) -> str:
        return _masked_repr(self, ("save_dir", "catalog_url", "local_dir", "memory_dir"))


@dataclass(kw_only=True, slots=True, repr=False)
class ModelStageConfig:
    """``model_stage_factory``: checkpoint only trainable parameters, frozen ones from a source."""

    checkpoint_only_trainable_parameters: bool = False
    #: a .safetensors file, a directory of them (with model.safetensors.index.json), or a
    #: Zephon checkpoint URL (<save_dir>/<run>/save-<step>)
    source_checkpoint: str | None = None
    prefix: str = "model_stage_factory"

    def __post_init__(self) -> None:
        flag = self.checkpoint_only_trainable_parameters
        if not isinstance(flag, bool):
            raise _fail(
                f"{self.prefix}.checkpoint_only_trainable_parameters", flag, "use true or false"
            )
        source = self.source_checkpoint
        if source is not None and (not isinstance(source, str) or not source.strip()):
            raise _fail(
                f"{self.prefix}.source_checkpoint",
                source,
                "use a path or URL of a .safetensors export or a Zephon checkpoint",
            )
        if flag and source is None:
            raise ConfigError(
                f"{self.prefix}.checkpoint_only_trainable_parameters is true but "
                f"{self.prefix}.source_checkpoint is not set: a resumed job needs the frozen "
                "parameters from somewhere; point source_checkpoint at the base model"
            )

    def __repr__(self) -> str:
        return _masked_repr(self, ("source_checkpoint",))


@dataclass(kw_only=True, slots=True)
class JobConfig:
    run_name: str | None
    total_steps: int | None
    checkpointing: CheckpointingConfig
    model_stage: ModelStageConfig = field(default_factory=ModelStageConfig)


def _section(tree: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = tree.get(key) or {}
    if not isinstance(value, Mapping):
        raise _fail(f"{where}{key}", value, "use a mapping")
    return value


_CHECKPOINTING_KEYS = {
    "save_dir",
    "period_steps",
    "num_to_keep",
    "keep_every_steps",
    "catalog_url",
    "storage_options",
    "async_save",
    "verify_on_load",
    "on_corrupt",
    "local_dir",
    "local_num_to_keep",
    "max_pending_uploads",
    "memory_tier",
    "memory_dir",
    "memory_num_to_keep",
    "memory_replicas",
    "dedup",
    "dedup_scope",
    "retry",
    "catalog_outage_s",
    "emergency_save",
    "auto_period",
    "metrics",
}
# model_stage_factory holds the product's other model settings too; only these are ours
_MODEL_STAGE_KEYS = {"checkpoint_only_trainable_parameters", "source_checkpoint"}


def load_job_config(source: str | os.PathLike | Mapping[str, Any]) -> JobConfig:
    """Build a ``JobConfig`` from a YAML file path or an already-parsed mapping."""
    if isinstance(source, Mapping):
        tree: Any = source
    else:
        import yaml

        try:
            with open(source) as handle:
                tree = yaml.safe_load(handle) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {os.fspath(source)!r} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"config file {os.fspath(source)!r} is not valid YAML: {exc}"
            ) from None
    if not isinstance(tree, Mapping):
        raise ConfigError(f"the job config must be a mapping at the top, got {type(tree).__name__}")
    run = _section(tree, "run", "")
    trainer = _section(tree, "trainer", "")
    checkpointing = _section(trainer, "checkpointing", "trainer.")
    stage = _section(tree, "model_stage_factory", "")
    unknown = sorted(set(checkpointing) - _CHECKPOINTING_KEYS)
    if unknown:
        raise ConfigError(
            f"trainer.checkpointing.{unknown[0]} is not a known setting; known: "
            f"{', '.join(sorted(_CHECKPOINTING_KEYS))}"
        )
    if "save_dir" not in checkpointing:
        raise ConfigError("trainer.checkpointing.save_dir is required: where checkpoints go")
    total = trainer.get("total_steps")
    if total is not None and not _positive_int(total):
        raise _fail("trainer.total_steps", total, f"use an integer from 1 to {MAX_STEP}")
    name = run.get("name")
    if name is not None:
        from zephon.storage import InvalidNameError, validate_run

        try:
            validate_run(name)
        except InvalidNameError:
            raise _fail("run.name", name, "use 1-128 characters of A-Z a-z 0-9 . _ -") from None
    return JobConfig(
        run_name=name,
        total_steps=total,
        checkpointing=CheckpointingConfig(**dict(checkpointing)),
        model_stage=ModelStageConfig(**{k: v for k, v in stage.items() if k in _MODEL_STAGE_KEYS}),
    )
