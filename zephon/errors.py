"""The zephon layer's exception root and the errors shared across its modules."""

from __future__ import annotations


class ZephonError(Exception):
    """Root of every error the zephon layer raises on purpose."""


class ConfigError(ZephonError, ValueError):
    """An invalid configuration value; the message names the key, the value and what is allowed."""
