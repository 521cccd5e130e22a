"""Fixtures of the save-on-preemption tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.servers import postgres_database


@pytest.fixture
def s3_place(s3, postgres_url) -> Iterator[dict[str, Any]]:
    """save_dir on moto's S3 with a PostgreSQL catalog."""
    bucket = f"zt-pre-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(bucket)
    with postgres_database(postgres_url) as catalog_url:
        yield {
            "save_dir": f"s3://{bucket}/ckpt",
            "storage_options": s3.storage_options(),
            "catalog_url": catalog_url,
        }
