"""The fault-injecting proxy (tests/faults.py) does what the fault tests rely on, against moto."""

from __future__ import annotations

import contextlib
import uuid

import botocore.exceptions
import pytest

from tests.faults import FaultProxy

#: what botocore raises when a connection breaks before the reply
_CONNECTION_LOST = (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)


def _client(url: str):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id="x",
        aws_secret_access_key="y",
        region_name="us-east-1",
        config=Config(retries={"total_max_attempts": 1, "mode": "standard"}, read_timeout=5),
    )


@pytest.fixture
def bucket(s3) -> str:
    name = f"zt-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(name)
    return name


def test_requests_pass_through_unchanged_without_faults(s3, bucket):
    with FaultProxy(s3.endpoint_url) as proxy:
        client = _client(proxy.url)
        client.put_object(Bucket=bucket, Key="a/b", Body=b"x" * 100_000)
        assert client.get_object(Bucket=bucket, Key="a/b")["Body"].read() == b"x" * 100_000
        assert client.head_object(Bucket=bucket, Key="a/b")["ContentLength"] == 100_000
        assert [r.outcome for r in proxy.log] == ["ok", "ok", "ok"]


def test_a_dropped_reply_is_applied_by_the_server_but_never_reaches_the_client(s3, bucket):
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.drop_reply(method="PUT", path=r"/_COMMIT$")
        client = _client(proxy.url)
        with pytest.raises(_CONNECTION_LOST):
            client.put_object(Bucket=bucket, Key="save-1/_COMMIT", Body=b"{}")
        stored = _client(s3.endpoint_url).get_object(Bucket=bucket, Key="save-1/_COMMIT")
        assert stored["Body"].read() == b"{}"
        assert proxy.pending_rules == 0


def test_scripted_failures_and_outages_never_reach_the_server(s3, bucket):
    with FaultProxy(s3.endpoint_url) as proxy:
        client = _client(proxy.url)
        proxy.fail(method="PUT", status=503)
        with pytest.raises(botocore.exceptions.ClientError, match="SlowDown"):
            client.put_object(Bucket=bucket, Key="k", Body=b"1")
        proxy.outage(True)
        with pytest.raises(_CONNECTION_LOST):
            client.put_object(Bucket=bucket, Key="k", Body=b"1")
        proxy.outage(False)
        direct = _client(s3.endpoint_url)
        assert direct.list_objects_v2(Bucket=bucket).get("KeyCount") == 0
        client.put_object(Bucket=bucket, Key="k", Body=b"1")
        assert [r.outcome for r in proxy.log] == ["fail", "outage", "ok"]


def test_a_truncated_reply_is_detected_by_the_client(s3, bucket):
    with FaultProxy(s3.endpoint_url) as proxy:
        direct = _client(s3.endpoint_url)
        direct.put_object(Bucket=bucket, Key="k", Body=b"y" * 10_000)
        proxy.set_rates(truncate=1.0)
        with pytest.raises((botocore.exceptions.BotoCoreError, ConnectionError)):
            _client(proxy.url).get_object(Bucket=bucket, Key="k")["Body"].read()


def test_random_faults_follow_the_seed(s3, bucket):
    def outcomes(seed: int) -> list[str]:
        with FaultProxy(s3.endpoint_url, seed=seed) as proxy:
            proxy.set_rates(error=0.3, slow_down=0.2)
            client = _client(proxy.url)
            for _ in range(20):
                with contextlib.suppress(botocore.exceptions.ClientError):
                    client.head_bucket(Bucket=bucket)
            return [r.outcome for r in proxy.log]

    first = outcomes(3)
    assert first == outcomes(3)
    assert {"error", "slow_down", "ok"} <= set(first)
    with pytest.raises(ValueError, match="add up to at most 1"):
        FaultProxy(s3.endpoint_url).set_rates(error=0.7, reset=0.5)
