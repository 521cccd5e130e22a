"""No credential leaves the storage layer: URLs, backend error texts, reprs and error messages
mask every secret while keeping the bucket and path that make the message useful."""

from __future__ import annotations

import pytest

from tests.servers import free_port
from zephon.storage import (
    NO_RETRY,
    BackendUnavailableError,
    CheckpointStore,
    CorruptCheckpointError,
    InvalidNameError,
    StorageError,
    open_location,
)
from zephon.storage.redact import mask_url, option_secrets, redact, redact_options, secrets_in

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzEXAMPLEKEY"
TOKEN = "FwoGZXIvYXdzEXAMPLE-session-token"


def dead_s3_options(**extra) -> dict:
    """S3 options pointing at a port nobody listens on, with credentials that must not leak."""
    return {
        "key": "AKIAIOSFODNN7EXAMPLE",
        "secret": SECRET,
        "token": TOKEN,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
        **extra,
    }


def assert_masked(text: str, *secrets: str, keeps: tuple[str, ...] = ()) -> None:
    for secret in secrets:
        assert secret not in text, f"{secret!r} leaked in {text!r}"
    for kept in keeps:
        assert kept in text, f"{kept!r} missing from {text!r}"


# -- one URL -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "secret", "expected"),
    [
        ("s3://AKIA:verysecret@bucket/p", "verysecret", "s3://AKIA:***@bucket/p"),
        # an unencoded "/" (common in AWS secrets) ends the authority early
        ("s3://AKIA:abc/def+ghi@bucket/p", "abc/def", "s3://AKIA:***@bucket/p"),
        ("https://user:pw-123456@host/x", "pw-123456", "https://user:***@host/x"),
        (
            "https://ghp_tokenvalue123@github.com/o/r",
            "ghp_tokenvalue123",
            "https://***@github.com/o/r",
        ),
        ("s3://bucket/x?secret=hunter2&a=1", "hunter2", "s3://bucket/x?secret=***&a=1"),
        (
            "gs://bucket/x?token=ya29.abc&generation=5",
            "ya29.abc",
            "gs://bucket/x?token=***&generation=5",
        ),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=deadbeef00",
            "deadbeef00",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***",
        ),
        ("https://host/x?access_token=tok123456", "tok123456", "https://host/x?access_token=***"),
        ("https://acct.blob.core.windows.net/c/p?sv=2022&sig=c2lnbmF0dXJl", "c2lnbmF0dXJl", None),
        ("https://app/cb#access_token=fragtok99&state=1", "fragtok99", None),
        ("postgresql://u:p@ss@db/x?password=qqq&sslmode=require", "p@ss", None),
    ],
)
def test_mask_url_hides_every_credential_and_keeps_the_rest(url, secret, expected):
    masked = mask_url(url)
    assert secret not in masked and "***" in masked
    if expected is not None:
        assert masked == expected


@pytest.mark.parametrize(
    "url",
    [
        "/plain/path",
        "s3://bucket/ckpt/run/save-5",
        "http://host:8080/model@v2/x",  # a port and an "@" in the path are not credentials
        "sftp://alice@host/data",  # a user name alone is not a secret, except over HTTP
        "abfs://container@account.dfs.core.windows.net/p",
        "s3://bucket/x?versionId=3&a=",
    ],
)
def test_mask_url_leaves_credential_free_urls_alone(url):
    assert mask_url(url) == url


# -- free text ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "secrets", "keeps"),
    [
        # botocore's ParamValidationError for s3://KEY:SECRET@b/x, whose "bucket" s3fs keeps
        (
            'Parameter validation failed: Invalid bucket name "AKIAXXXX:URLSECRET7@b": Bucket '
            "name must match the regex",
            ["URLSECRET7"],
            ['"AKIAXXXX:***@b"', "Bucket name must match"],
        ),
        # fsspec's FileNotFoundError of a key that kept a query string
        ("[Errno 2] No such file: 'b/ckpt?X-Amz-Signature=SIG123456/r'", ["SIG123456"], ["b/ckpt"]),
        # a listing URL echoed whole, and an endpoint with credentials
        (
            "Could not connect to the endpoint URL: "
            '"http://u:EPPASS1234@127.0.0.1:9/b?list-type=2&prefix=ckpt%2F"',
            ["EPPASS1234"],
            ["127.0.0.1:9/b?list-type=2&prefix=ckpt%2F"],
        ),
        # storage_options echoed by a TypeError or a logging call
        (
            "__init__() got {'key': 'AKIA', 'secret': 'abc def', \"token\": \"t0ken\", "
            "'endpoint_url': 'http://127.0.0.1:9000'}",
            ["abc def", "t0ken"],
            ["'endpoint_url': 'http://127.0.0.1:9000'"],
        ),
        (
            "Authorization: Bearer eyJhbGciOiJIUzI1; password=hunter2 aws_secret_access_key=ZZZ1 "
            "session_token: QQQ2 sig=SSS3",
            ["eyJhbGciOiJIUzI1", "hunter2", "ZZZ1", "QQQ2", "SSS3"],
            ["Authorization: Bearer ***"],
        ),
        (
            "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=AKEYVALUE==;X=1",
            ["AKEYVALUE"],
            ["AccountName=acct;AccountKey=***;X=1"],
        ),
        (
            "catalog postgresql+psycopg://alice@127.0.0.1:5432/db?password=PGSECRET1 is "
            "unavailable",
            ["PGSECRET1"],
            ["postgresql+psycopg://alice@127.0.0.1:5432/db?password=***"],
        ),
    ],
)
def test_redact_masks_urls_pairs_and_userinfo_inside_free_text(text, secrets, keeps):
    assert_masked(redact(text), *secrets, keeps=tuple(keeps))


@pytest.mark.parametrize(
    "text",
    [
        "check the credentials and permissions in storage_options",
        'connection to server at "127.0.0.1", port 5432 failed: FATAL:  password authentication '
        'failed for user "bob"',
        "at 2024-01-01T10:00:00 user@example.com saw 127.0.0.1:8080/v1@x",
        "writing model/0.bin to s3://bucket/ckpt/r/save-5 failed",
        # an exception type or error code and its message, not a name: value pair
        "NoCredentialsError: Unable to locate credentials",
        "ExpiredToken: The provided token has expired",
    ],
)
def test_redact_leaves_ordinary_messages_alone(text):
    assert redact(text) == text


def test_known_secrets_are_scrubbed_wherever_they_appear():
    text = f"the backend said: bad signature for {SECRET} (sent as {SECRET.lower()})"
    assert SECRET not in redact(text, [SECRET])
    assert redact("anonymous access", ["anon"]) == "anonymous access"  # too short to scrub


def test_secrets_are_found_in_urls_options_and_json():
    assert {"URLSECRET7", SECRET, "pw-123456"} <= secrets_in(
        '{"secret": "' + SECRET + '", "client_kwargs": {"endpoint_url": "http://u:pw-123456@h"}}'
    ) | secrets_in("s3://AKIA:URLSECRET7@b/x")
    found = option_secrets({"token": "anon", "credentials": {"private_key": "PEMDATA-1"}})
    assert "PEMDATA-1" in found and "anon" not in found


def test_redact_options_masks_nested_credentials_for_display():
    shown = redact_options(
        {
            "key": "AKIA",
            "Secret": SECRET,
            "anon": False,
            "client_kwargs": {
                "endpoint_url": "http://u:EPPASS1234@minio:9000",
                "aws_session_token": TOKEN,
                "region_name": "eu-west-1",
            },
            "headers": {"Authorization": "Bearer abc"},
            "token": None,
        }
    )
    assert shown == {
        "key": "***",
        "Secret": "***",
        "anon": False,
        "client_kwargs": {
            "endpoint_url": "http://u:***@minio:9000",
            "aws_session_token": "***",
            "region_name": "eu-west-1",
        },
        "headers": {"Authorization": "***"},
        "token": None,
    }


# -- locations, stores, errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("s3://AKIAXXXX:URLSECRET7@bucket/ckpt", "URLSECRET7"),
        ("s3://AKIAXXXX@bucket/ckpt", None),
        ("s3://AKIAXXXX:abc123/def456@bucket/ckpt", "abc123"),  # unencoded "/" in the secret
        ("s3://bucket/ckpt?X-Amz-Signature=SIG123456", "SIG123456"),
        ("s3://bucket/ckpt?secret=SEC123456", "SEC123456"),
        ("gs://bucket/ckpt?token=ya29.TOKEN99", "ya29.TOKEN99"),
        ("gs://user:GSPASS123@bucket/ckpt", "GSPASS123"),
    ],
)
def test_object_store_urls_with_credentials_are_refused_with_the_fix(url, secret):
    with pytest.raises(InvalidNameError) as info:
        CheckpointStore(url, {"anon": True})
    message = str(info.value)
    assert "storage_options" in message and "bucket/ckpt" in message
    if secret is not None:
        assert_masked(message, secret)
        assert secret not in info.value.url


def test_reprs_of_locations_and_stores_show_no_credentials():
    options = dead_s3_options()
    store = CheckpointStore("s3://bucket/ckpt", options)
    for shown in (repr(store), str(store), f"{store}", repr(store.location), f"{store.location}"):
        assert_masked(shown, SECRET, TOKEN, keeps=("s3://bucket/ckpt",))
    assert SECRET in store.location.secrets  # kept for scrubbing backend texts, never shown


def test_http_locations_display_without_the_password():
    location = open_location("https://user:HTTPPW123@127.0.0.1:9/data")
    for shown in (
        location.url,
        location.canonical_url,
        location.display(location.join("run", "save-1")),
        repr(location),
    ):
        assert_masked(shown, "HTTPPW123", keeps=("127.0.0.1:9/data",))


def test_unreachable_endpoint_errors_mask_every_secret_on_every_operation():
    store = CheckpointStore("s3://bucket/ckpt", dead_s3_options(), retry=NO_RETRY)
    operations = [
        lambda: store.runs(),
        lambda: store.run("r").committed_steps(),
        lambda: store.run("r").latest(),
        lambda: store.run("r").lineage(),
    ]
    for operation in operations:
        with pytest.raises(BackendUnavailableError) as info:
            operation()
        assert_masked(str(info.value), SECRET, TOKEN, keeps=("s3://bucket/ckpt",))


def test_a_bucket_that_does_not_exist_is_reported_without_secrets(s3):
    options = {**s3.storage_options(), "key": "AKIAIOSFODNN7EXAMPLE", "secret": SECRET}
    store = CheckpointStore("s3://zephon-no-such-bucket/ckpt", options)
    assert store.run("r").latest() is None and store.runs() == []
    writer = store.run("r").begin(1)
    with pytest.raises(StorageError) as info:
        writer.write_bytes("a.bin", b"1")
    assert_masked(str(info.value), SECRET, keeps=("s3://zephon-no-such-bucket/ckpt",))


def test_backend_texts_are_redacted_where_they_are_translated():
    import botocore.exceptions

    location = open_location("memory://zephon-secrets/ckpt", {"secret": SECRET}, retry=NO_RETRY)
    leaks = [
        botocore.exceptions.ParamValidationError(
            report='Invalid bucket name "AKIAXXXX:URLSECRET7@b": Bucket name must match'
        ),
        ConnectionError(f"peer rejected credential {SECRET}"),  # out of any recognisable context
        OSError(5, "I/O error", "b/ckpt?X-Amz-Signature=SIG123456"),
    ]
    for exc in leaks:

        def failing(path: str, *, prefix: str = "", exc: Exception = exc) -> None:
            raise exc

        location.backend._list_files = failing  # the backend translates what fsspec raised
        with pytest.raises(BackendUnavailableError) as info:
            location.backend.list_files(location.root)
        assert_masked(
            str(info.value), SECRET, "URLSECRET7", "SIG123456", keeps=("memory://zephon-secrets",)
        )


def test_every_storage_error_is_redacted_on_construction():
    error = CorruptCheckpointError(
        f"marker of s3://AKIA:URLSECRET7@b/x failed: secret={SECRET}",
        problems=[f"file a: token={TOKEN}"],
        url="s3://AKIA:URLSECRET7@b/x",
    )
    assert_masked(str(error), "URLSECRET7", SECRET, keeps=("s3://AKIA:***@b/x",))
    assert_masked(" ".join(error.problems), TOKEN)
    assert error.url == "s3://AKIA:***@b/x"


# -- Azure: connection strings and the environment adlfs reads --------------------------------

AZURE_KEY = "QXp1cmVTZWNyZXRLZXlRWEJ6ZFhKbFUyVmpjbVYwUzJWNQ=="
AZURE_CONNECTION = (
    "DefaultEndpointsProtocol=https;AccountName=acct;"
    f"AccountKey={AZURE_KEY};EndpointSuffix=core.windows.net"
)


def test_the_key_inside_an_azure_connection_string_is_a_secret_of_its_own():
    found = option_secrets({"connection_string": AZURE_CONNECTION})
    assert AZURE_CONNECTION in found and AZURE_KEY in found
    # an SDK message quoting the key alone, out of any name=value context
    assert_masked(redact(f"bad key {AZURE_KEY}", found), AZURE_KEY, keeps=("bad key",))
    echoed = f"cannot parse {AZURE_CONNECTION}"
    assert_masked(redact(echoed), AZURE_KEY)
    shown = redact_options({"connection_string": AZURE_CONNECTION, "account_name": "acct"})
    assert shown == {"connection_string": "***", "account_name": "acct"}


@pytest.mark.parametrize(
    "variable",
    ["AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"],
)
def test_azure_credentials_in_the_environment_are_scrubbed_too(variable, monkeypatch):
    from adlfs import AzureBlobFileSystem

    AzureBlobFileSystem.clear_instance_cache()  # adlfs reads the environment when made
    value = AZURE_CONNECTION if variable.endswith("STRING") else AZURE_KEY
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    location = open_location("az://container/ckpt", retry=NO_RETRY)
    AzureBlobFileSystem.clear_instance_cache()
    assert AZURE_KEY in location.secrets
    assert_masked(repr(location), AZURE_KEY)
