"""The catalog layer's exception root."""

from __future__ import annotations


class CatalogError(Exception):
    """Root of every error the catalog layer raises on purpose."""
