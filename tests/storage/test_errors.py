"""Storage errors name the URL (credentials masked), the object and the fix."""

from __future__ import annotations

import pytest

from tests.servers import free_port
from zephon.storage import (
    NO_RETRY,
    BackendUnavailableError,
    CheckpointStore,
    InvalidNameError,
    StorageError,
    mask_url,
    open_location,
)


def test_every_storage_error_shares_the_root():
    for cls in (BackendUnavailableError, InvalidNameError):
        assert issubclass(cls, StorageError)


def test_missing_protocol_package_names_the_package_to_install():
    # ossfs is in no extra of ours, so it is missing wherever the tests run
    with pytest.raises(BackendUnavailableError, match=r"needs ossfs.*pip install ossfs"):
        CheckpointStore("oss://bucket/ckpt")


def test_unknown_protocol_is_a_clear_error():
    with pytest.raises(StorageError, match="nosuchproto://x/y"):
        CheckpointStore("nosuchproto://x/y")


@pytest.mark.parametrize("url", ["", "   ", None, 5])
def test_empty_or_non_string_url_is_refused(url):
    with pytest.raises(InvalidNameError, match="storage URL must be a non-empty string"):
        CheckpointStore(url)


def test_chained_urls_are_refused():
    with pytest.raises(InvalidNameError, match="chained fsspec URLs"):
        CheckpointStore("simplecache::s3://bucket/x")


def test_bucket_less_url_is_refused():
    with pytest.raises(InvalidNameError, match="names no bucket"):
        CheckpointStore("s3://", {"anon": True})


def test_credentials_are_masked_in_urls():
    assert mask_url("s3://AKIA:verysecret@bucket/p") == "s3://AKIA:***@bucket/p"
    assert "hunter2" not in mask_url("http://h/x?token=hunter2&a=1")
    assert mask_url("/plain/path") == "/plain/path"


def test_unreachable_endpoint_is_backend_unavailable_and_masks_secrets():
    dead = f"http://127.0.0.1:{free_port()}"
    options = {
        "key": "AKIAEXAMPLE",
        "secret": "super-secret-value",
        "client_kwargs": {"endpoint_url": dead},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    store = CheckpointStore("s3://bucket/ckpt", options, retry=NO_RETRY)
    with pytest.raises(BackendUnavailableError) as info:
        store.run("r").committed_steps()
    message = str(info.value)
    assert "s3://bucket/ckpt" in message and "storage_options" in message
    assert "super-secret-value" not in message


def test_writing_to_a_missing_bucket_names_the_checkpoint(s3):
    store = CheckpointStore("s3://no-such-bucket-zephon/ckpt", s3.storage_options())
    writer = store.run("r").begin(1)
    with pytest.raises(
        BackendUnavailableError,
        match=r"writing s3://no-such-bucket-zephon/"
        r"ckpt/r/save-1/[0-9a-z-]+/a failed.*must exist: create it first",
    ):
        writer.write_bytes("a", b"1")


def test_location_join_and_display_are_consistent(tmp_path):
    location = open_location(str(tmp_path))
    path = location.join("run", "save-1")
    assert path == f"{tmp_path}/run/save-1" and location.display(path) == path


def _claim(store: CheckpointStore) -> str:
    """The one-line error of claiming the first attempt of run "r" on ``store``."""
    with pytest.raises(BackendUnavailableError) as caught:
        store.run("r").claim_attempt(after=store.run("r").lineage())
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_claiming_an_attempt_in_a_missing_bucket_names_the_bucket_and_the_fix(s3):
    store = CheckpointStore("s3://no-such-bucket-zephon/ckpt", s3.storage_options())
    message = _claim(store)
    assert "creating s3://no-such-bucket-zephon/ckpt/r/_attempts/" in message
    assert "the bucket s3://no-such-bucket-zephon must exist: create it first" in message


@pytest.mark.parametrize("under", ["/proc/no-such-dir", "{file}"], ids=["proc", "file"])
def test_claiming_an_attempt_where_no_directory_can_be_made_names_the_path(under, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    url = f"{under.format(file=blocker)}/ckpt"
    message = _claim(CheckpointStore(url))
    assert f"the directory {url} must exist or be creatable" in message


def test_claiming_an_attempt_on_a_read_only_disk_says_so(tmp_path, mounts):
    (tmp_path / "ro").mkdir()
    mounts.read_only(tmp_path / "ro")
    url = str(tmp_path / "ro" / "ckpt")
    message = _claim(CheckpointStore(url))
    assert f"{url} is on a read-only filesystem: remount it read-write" in message
    assert "endpoint" not in message
