"""What Azure Blob Storage does its own way, against Azurite: the create-only marker's
request, retries through a faulty network with the SDK's own retries off, Azure's replies
classified and translated, and credentials (storage options or the environment adlfs reads)
kept out of every message. The rest runs in the conformance suites (``backend`` fixture)."""

from __future__ import annotations

import logging
import re
import uuid

import pytest

from tests.conftest import random_payload
from tests.faults import FaultProxy
from tests.servers import AZURITE_ACCOUNT, AZURITE_KEY, AzuriteServer, free_port
from zephon.storage import (
    NO_RETRY,
    BackendUnavailableError,
    CheckpointStore,
    RetryPolicy,
    StorageError,
    StorageOptionsRefusedError,
)
from zephon.storage.backends import AzureBackend, backend_for
from zephon.storage.retry import is_throttling, is_transient, reply_status

PART = 5 << 20
QUICK = RetryPolicy(
    max_attempts=50, deadline_s=20, base_backoff_s=0.01, max_backoff_s=0.2, throttle_backoff_s=0.05
)


def connection_string(endpoint: str, key: str = AZURITE_KEY) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
        f"BlobEndpoint={endpoint};"
    )


def new_container(azurite: AzuriteServer) -> str:
    name = f"zt-{uuid.uuid4().hex[:12]}"
    azurite.create_container(name)
    return name


def test_every_azure_protocol_opens_the_azure_backend(azure_backend):
    for protocol in ("az", "abfs", "abfss"):
        assert backend_for(protocol) is AzureBackend
    for scheme in ("abfs", "az"):
        url = azure_backend.url.replace("az://", f"{scheme}://")
        with CheckpointStore(url, azure_backend.storage_options) as store:
            assert type(store.location.backend) is AzureBackend
            assert store.location.canonical_url == url  # named as the user named it


def test_the_marker_and_attempt_records_are_puts_with_if_none_match_star(azure_backend, caplog):
    """The SDK sends ``upload_blob(overwrite=False)`` as a Put Blob with ``If-None-Match: *``
    (its request log shows the header); Azurite's refusal of a second one is what the
    conformance race counts on. Payload files are plain puts."""
    caplog.set_level(logging.INFO, logger="azure.core.pipeline.policies.http_logging_policy")
    with azure_backend.open_store() as store:
        run = store.run("r")
        fence = run.decide_resume(run.claim_attempt(after=run.lineage()), resumed_from=None)
        with run.begin(1, fence=fence) as writer:
            writer.write_bytes("a.bin", b"a")
            writer.commit()
    puts = {}
    for record in caplog.records:
        found = re.match(r"Request URL: '([^']+)'\s+Request method: 'PUT'", record.getMessage())
        if found:
            puts[found[1].rsplit("/", 1)[-1]] = "'If-None-Match': '*'" in record.getMessage()
    # the payload is a plain put: through the SDK, or through the native client (not logged)
    assert puts.pop("a.bin", False) is False
    assert puts == {
        "0000000001.json": True,  # the attempt's claim
        "0000000001.resume.json": True,  # its resume decision
        "_COMMIT": True,
    }


def test_a_save_and_a_load_ride_out_faults_with_the_sdks_own_retries_off(azure_backend, azurite):
    files = {f"f{i}.bin": random_payload(1000 + i) for i in range(8)}
    big = random_payload(2 * PART + 17)  # three staged blocks
    with FaultProxy(azurite.endpoint_url, seed=7) as proxy:
        endpoint = f"{proxy.url}/{AZURITE_ACCOUNT}"
        options = {"connection_string": connection_string(endpoint)}
        with CheckpointStore(azure_backend.url, options, retry=QUICK, part_size=PART) as store:
            config = store.location.fs.service_client._config
            assert config.retry_policy.total_retries == 0  # one policy: Zephon's
            proxy.set_rates(error=0.1, reset=0.05, slow_down=0.05)
            with store.run("r").begin(1) as writer:
                writer.write_many({**files, "big.bin": big})
                with writer.open("streamed.bin") as out:
                    out.write(big)
                writer.commit()
            reader = store.run("r").reader(1)
            for name, data in {**files, "big.bin": big, "streamed.bin": big}.items():
                assert reader.read_bytes(name) == data
            assert store.run("r").verify(1, deep=True).ok
            proxy.set_rates()
    faults = [r for r in proxy.log if r.outcome in ("error", "reset", "slow_down")]
    assert faults, "the proxy injected nothing"
    staged = [r for r in proxy.log if r.method == "PUT" and "comp=block&" in r.path]
    assert len({r.path for r in staged}) == 6  # three blocks each for big.bin and streamed.bin


def test_a_missing_container_names_the_container_to_create(azurite):
    options = {"connection_string": azurite.connection_string}
    with CheckpointStore("az://zt-no-such-container/ckpt", options, retry=NO_RETRY) as store:
        assert store.run("r").latest() is None and store.runs() == []
        with pytest.raises(BackendUnavailableError) as info, store.run("r").begin(1) as writer:
            writer.write_bytes("a.bin", b"1")
    message = str(info.value)
    assert "the container az://zt-no-such-container must exist" in message
    assert AZURITE_KEY not in message


def test_a_wrong_key_is_refused_once_without_showing_the_key(azurite):
    wrong = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXk="
    options = {"connection_string": connection_string(azurite.endpoint_url, wrong)}
    container = new_container(azurite)
    store = CheckpointStore(f"az://{container}/ckpt", options)
    with store, pytest.raises(BackendUnavailableError) as info:
        store.run("r").latest()
    message = str(info.value)
    assert wrong not in message and "connection_string" not in message.lower()
    assert "check the credentials and permissions in storage_options" in message
    assert reply_status(info.value.__cause__) == 403
    assert not re.search(r"after \d+ attempts", message)  # a refusal is not tried again


@pytest.fixture
def fresh_filesystems():
    """adlfs reads the environment when a filesystem is made, and fsspec keeps one instance
    per set of options: a test that changes the environment needs new ones (and leaves none)."""
    from adlfs import AzureBlobFileSystem

    AzureBlobFileSystem.clear_instance_cache()
    yield
    AzureBlobFileSystem.clear_instance_cache()


def test_credentials_from_the_environment_never_appear_in_errors(monkeypatch, fresh_filesystems):
    secret_key = "RW52aXJvbm1lbnRTZWNyZXRLZXlFbnZpcm9ubWVudA=="
    dead = f"http://127.0.0.1:{free_port()}/{AZURITE_ACCOUNT}"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(dead, secret_key))
    with CheckpointStore("az://c/ckpt", retry=NO_RETRY) as store:
        assert secret_key in store.location.secrets  # scrubbed from backend texts
        with pytest.raises(StorageError) as info:
            store.run("r").latest()
        assert secret_key not in str(info.value) and secret_key not in repr(store)
    assert "az://c/ckpt" in str(info.value)


# -- the classifier on Azure's replies ---------------------------------------------------------


def reply(status: int, code: str, cls: type | None = None, headers: dict | None = None):
    """An azure.core error as the SDK raises it for an error reply."""
    from azure.core.exceptions import HttpResponseError

    error = (cls or HttpResponseError)(message=f"{code} ({status})")
    error.status_code = status
    error.error_code = code
    error.response = type("Reply", (), {"headers": headers or {}})()
    return error


@pytest.mark.parametrize(
    ("status", "code", "transient"),
    [
        (500, "InternalError", True),
        (503, "ServerBusy", True),
        (500, "OperationTimedOut", True),
        (408, "", True),
        (429, "", True),
        (501, "", False),
        (400, "InvalidInput", False),
        (403, "AuthenticationFailed", False),
        (404, "BlobNotFound", False),
        (409, "BlobAlreadyExists", False),
        (412, "ConditionNotMet", False),
    ],
)
def test_the_classifier_on_azure_replies(status, code, transient):
    assert is_transient(reply(status, code)) is transient


def test_the_classifier_on_azure_transport_failures_and_throttling():
    from azure.core.exceptions import (
        ServiceRequestError,
        ServiceRequestTimeoutError,
        ServiceResponseError,
        ServiceResponseTimeoutError,
    )

    for cls in (
        ServiceRequestError,
        ServiceRequestTimeoutError,
        ServiceResponseError,
        ServiceResponseTimeoutError,
    ):
        assert is_transient(cls("connection broke")), cls
    busy = reply(503, "ServerBusy", headers={"Retry-After": "2"})
    assert is_throttling(busy)


def test_azures_answers_become_the_builtin_file_errors(azure_backend):
    """404, 409 and 412 are answers (not found, exists), never outages: the translation turns
    azure.core's classes into the builtin errors every caller already handles."""
    from azure.core.exceptions import (
        ResourceExistsError,
        ResourceModifiedError,
        ResourceNotFoundError,
    )

    with CheckpointStore(azure_backend.url, azure_backend.storage_options) as store:
        backend = store.location.backend
        for error, answer in (
            (reply(404, "BlobNotFound", ResourceNotFoundError), FileNotFoundError),
            (reply(409, "BlobAlreadyExists", ResourceExistsError), FileExistsError),
            (reply(412, "ConditionNotMet", ResourceModifiedError), FileExistsError),
        ):

            def failing(path: str, error: Exception = error) -> bytes:
                raise error

            backend._read_small = failing
            with pytest.raises(answer):
                backend.read_small(store.location.join("x"))


# -- lost replies (docs/fencing.md): a create-only put applied by Azure, its reply lost --------


def test_create_only_puts_whose_reply_was_lost_are_settled_as_the_writers_own(
    azure_backend, azurite
):
    """The marker's and the attempt records' Put Blob reach Azurite, their replies are lost:
    tried again, Azure answers 409 for the writer's own blob, and reading it back settles
    that the attempt was claimed, it decided, and the checkpoint committed."""
    files = {"weights.bin": random_payload(70_000), "optim/state.bin": random_payload(1_000)}
    drops = 2  # aiohttp resends an idempotent PUT once by itself when a reused connection breaks
    with FaultProxy(azurite.endpoint_url, seed=7) as proxy:
        options = {"connection_string": connection_string(f"{proxy.url}/{AZURITE_ACCOUNT}")}
        with CheckpointStore(azure_backend.url, options, retry=QUICK) as store:
            run = store.run("r")
            proxy.drop_reply(method="PUT", path=r"/_attempts/\d+\.json(\?|$)", count=drops)
            fence = run.claim_attempt(after=run.lineage())
            proxy.drop_reply(method="PUT", path=r"/_attempts/\d+\.resume\.json(\?|$)", count=drops)
            fence = run.decide_resume(fence, resumed_from=None)
            assert run.lineage().current == fence.record and fence.epoch == 1
            with run.begin(5, fence=fence) as writer:
                writer.write_many(files)
                proxy.drop_reply(method="PUT", path=r"/save-5/_COMMIT(\?|$)", count=drops)
                manifest = writer.commit()
            writer.abort()  # a committed save is never removed
        assert len(proxy.outcomes("drop_reply")) == 3 * drops and proxy.pending_rules == 0
    with azure_backend.open_store() as direct:
        assert direct.run("r").read_manifest(5) == manifest
        assert manifest.save_id == writer.save_id
        reader = direct.run("r").reader(5)
        assert {name: reader.read_bytes(name) for name in files} == files


def test_a_url_without_an_account_says_which_options_adlfs_needs(monkeypatch, fresh_filesystems):
    for variable in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(StorageOptionsRefusedError) as info:
        CheckpointStore("az://container/ckpt")
    message = str(info.value)
    assert "az://container/ckpt" in message and "\n" not in message
    assert "connection_string, or account_name with account_key" in message
