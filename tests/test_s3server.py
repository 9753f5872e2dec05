"""The SeaweedFS test server (tests/s3server.py) behaves as the trainer's S3 storage will rely on.

Every s3fs filesystem here is built with NO endpoint or keys: only the environment (`use_env`), as
in a trainer subprocess. The exact exception classes are asserted because the trainer maps them to
exit codes:

  wrong secret / unknown key   s3fs: PermissionError (cause ClientError SignatureDoesNotMatch /
                               InvalidAccessKeyId; a HEAD-based call says only "Forbidden", code 403)
  missing bucket               s3fs: FileNotFoundError("The specified bucket does not exist")
                               (cause NoSuchBucket); boto3: NoSuchBucket, 404. Never auto-created.
  create-only write, 2nd time  s3fs: OSError(errno.EINVAL) -- NOT FileExistsError: SeaweedFS's 412
                               has no <Condition> element, which s3fs needs to say FileExistsError;
                               boto3: ClientError PreconditionFailed, 412
  If-Match with a stale ETag   boto3: ClientError PreconditionFailed, 412; s3fs: OSError(EINVAL)
  closed port                  botocore.exceptions.EndpointConnectionError, NOT an OSError (s3fs
                               passes it through untranslated)
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import boto3
import botocore.exceptions
import fsspec.asyn
import pytest
import s3fs
from botocore.exceptions import ClientError

from support.limits import scaled
from support.s3 import S3Bucket

PRECONDITION_MESSAGE = "At least one of the pre-conditions you specified did not hold"
STALE_ETAG = '"0123456789abcdef0123456789abcdef"'


def client_error(error: BaseException) -> ClientError:
    """The botocore ClientError behind an s3fs exception."""
    assert isinstance(error.__cause__, ClientError), repr(error)
    return error.__cause__


def code_and_status(error: ClientError) -> tuple[str, int]:
    return error.response["Error"]["Code"], error.response["ResponseMetadata"]["HTTPStatusCode"]


def fresh_boto3_client():
    """boto3.client() goes through boto3's module-level default session, which resolves the
    credentials once and keeps them: later changes to AWS_* would not be seen. A new Session reads
    the environment afresh."""
    return boto3.session.Session().client("s3")


def put_if(fs: s3fs.S3FileSystem, bucket: str, key: str, body: bytes, **condition) -> dict:
    """A conditional PutObject through s3fs's own client and retry wrapper."""
    return fsspec.asyn.sync(fs.loop, fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=body, **condition)


@pytest.fixture
def fs(s3_bucket: S3Bucket, monkeypatch) -> s3fs.S3FileSystem:
    s3_bucket.use_env(monkeypatch)
    return s3fs.S3FileSystem(skip_instance_cache=True)


def test_env_alone_reaches_the_server_from_boto3_s3fs_and_a_subprocess(s3_bucket, fs, monkeypatch):
    assert fresh_boto3_client().meta.endpoint_url == s3_bucket.server.endpoint_url
    assert fs.s3.meta.endpoint_url == s3_bucket.server.endpoint_url
    fs.pipe_file(f"{s3_bucket.name}/hello.txt", b"hello")
    script = ("import s3fs, sys; fs = s3fs.S3FileSystem(); "
              f"sys.stdout.write(fs.cat_file('{s3_bucket.name}/hello.txt').decode()); "
              f"fs.pipe_file('{s3_bucket.name}/from-child.txt', b'child')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3_bucket.env()
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello"
    assert s3_bucket.keys() == ["from-child.txt", "hello.txt"]


def test_wrong_credentials_are_refused(s3_bucket, monkeypatch):
    s3_bucket.use_env(monkeypatch)
    path = f"{s3_bucket.name}/x"

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    wrong_secret = s3fs.S3FileSystem(skip_instance_cache=True)
    with pytest.raises(PermissionError) as caught:
        wrong_secret.pipe_file(path, b"x")
    assert type(caught.value) is PermissionError
    assert str(caught.value) == ("The request signature we calculated does not match the signature you "
                                 "provided. Check your key and signing method.")
    assert code_and_status(client_error(caught.value)) == ("SignatureDoesNotMatch", 403)
    # HEAD has no body, so the code is only the status: "403" / "Forbidden"; still PermissionError.
    with pytest.raises(PermissionError, match="^Forbidden$") as caught:
        wrong_secret.info(path)
    assert code_and_status(client_error(caught.value)) == ("403", 403)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "no-such-access-key")
    unknown_key = s3fs.S3FileSystem(skip_instance_cache=True)
    with pytest.raises(PermissionError, match="^The access key ID you provided does not exist in our records.$") \
            as caught:
        unknown_key.ls(s3_bucket.name)
    assert code_and_status(client_error(caught.value)) == ("InvalidAccessKeyId", 403)

    with pytest.raises(ClientError) as caught:
        fresh_boto3_client().put_object(Bucket=s3_bucket.name, Key="x", Body=b"x")
    assert code_and_status(caught.value) == ("InvalidAccessKeyId", 403)
    assert s3_bucket.keys() == []


def test_a_missing_bucket_is_not_found_and_never_created(s3_bucket, fs):
    missing = "no-such-bucket-" + s3_bucket.name[-8:]
    with pytest.raises(FileNotFoundError, match="^The specified bucket does not exist$") as caught:
        fs.pipe_file(f"{missing}/x", b"x")
    assert code_and_status(client_error(caught.value)) == ("NoSuchBucket", 404)
    with pytest.raises(FileNotFoundError, match="^The specified bucket does not exist$"):
        fs.ls(missing)
    assert fs.exists(f"{missing}/x") is False  # exists() swallows it

    client = fresh_boto3_client()
    with pytest.raises(client.exceptions.NoSuchBucket) as caught:
        client.put_object(Bucket=missing, Key="x", Body=b"x")
    assert code_and_status(caught.value) == ("NoSuchBucket", 404)
    assert missing not in [b["Name"] for b in client.list_buckets()["Buckets"]]  # -s3.autoCreateBucket=false
    # a missing key in an existing bucket
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{s3_bucket.name}/no-such-key")


def test_create_only_writes_succeed_once(s3_bucket, fs):
    path = f"{s3_bucket.name}/once"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(OSError) as caught:
        fs.pipe_file(path, b"second", mode="create")
    # On AWS this is FileExistsError (s3fs keys it on <Condition>If-None-Match</Condition>, which
    # SeaweedFS does not send); here it is a plain OSError(EINVAL) with the 412 behind it.
    assert type(caught.value) is OSError and caught.value.errno == errno.EINVAL
    assert caught.value.strerror == PRECONDITION_MESSAGE
    assert code_and_status(client_error(caught.value)) == ("PreconditionFailed", 412)
    assert "Condition" not in client_error(caught.value).response["Error"]
    with pytest.raises(OSError) as caught:
        with fs.open(path, "xb") as f:  # the "x" mode of open() sends the same If-None-Match: *
            f.write(b"third")
    assert code_and_status(client_error(caught.value)) == ("PreconditionFailed", 412)
    assert fs.cat_file(path) == b"first"

    client = s3_bucket.client()
    client.put_object(Bucket=s3_bucket.name, Key="boto", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=s3_bucket.name, Key="boto", Body=b"second", IfNoneMatch="*")
    assert code_and_status(caught.value) == ("PreconditionFailed", 412)
    assert caught.value.response["Error"]["Message"] == PRECONDITION_MESSAGE
    assert client.get_object(Bucket=s3_bucket.name, Key="boto")["Body"].read() == b"first"


def test_if_match_refuses_a_stale_etag_and_accepts_the_current_one(s3_bucket, fs):
    client, bucket = s3_bucket.client(), s3_bucket.name
    first = client.put_object(Bucket=bucket, Key="k", Body=b"one")["ETag"]

    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=bucket, Key="k", Body=b"two", IfMatch=STALE_ETAG)
    assert code_and_status(caught.value) == ("PreconditionFailed", 412)
    second = client.put_object(Bucket=bucket, Key="k", Body=b"two", IfMatch=first)["ETag"]
    assert second != first
    with pytest.raises(ClientError) as caught:  # the ETag it replaced is stale now
        client.put_object(Bucket=bucket, Key="k", Body=b"three", IfMatch=first)
    assert code_and_status(caught.value) == ("PreconditionFailed", 412)
    # AWS answers 404 NoSuchKey to If-Match on a missing key; SeaweedFS answers 412.
    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=bucket, Key="missing", Body=b"x", IfMatch=first)
    assert code_and_status(caught.value) == ("PreconditionFailed", 412)

    # the same through s3fs's client
    with pytest.raises(OSError) as caught:
        put_if(fs, bucket, "k", b"four", IfMatch=first)
    assert type(caught.value) is OSError and caught.value.errno == errno.EINVAL
    assert code_and_status(client_error(caught.value)) == ("PreconditionFailed", 412)
    current = fs.info(f"{bucket}/k")["ETag"]
    assert current == second
    put_if(fs, bucket, "k", b"four", IfMatch=current)
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"four"


def test_complete_multipart_upload_honours_if_none_match_and_if_match(s3_bucket):
    client, bucket = s3_bucket.client(), s3_bucket.name

    def multipart(key: str, body: bytes, **condition) -> dict:
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        part = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=body)
        try:
            return client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload,
                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}, **condition)
        except ClientError:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)  # a 412 leaves it open
            raise

    first = multipart("m", b"one", IfNoneMatch="*")["ETag"]
    with pytest.raises(ClientError) as caught:
        multipart("m", b"two", IfNoneMatch="*")
    assert code_and_status(caught.value) == ("PreconditionFailed", 412)
    with pytest.raises(ClientError) as caught:
        multipart("m", b"two", IfMatch=STALE_ETAG)
    assert code_and_status(caught.value) == ("PreconditionFailed", 412)
    assert client.get_object(Bucket=bucket, Key="m")["Body"].read() == b"one"
    multipart("m", b"two", IfMatch=first)
    assert client.get_object(Bucket=bucket, Key="m")["Body"].read() == b"two"
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.fixture
def closed_port_env(monkeypatch) -> str:
    """The environment of a server that is not there: a loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": "/nonexistent",
                        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}.items():
        monkeypatch.setenv(name, value)
    return endpoint


ONE_TRY_S = 5.0
"""Well under the 7-12 s botocore's five tries with back-off take, well over one refused
connect on an idle machine (milliseconds): a loaded one took 2.5 s."""


def failure(fs: s3fs.S3FileSystem) -> tuple[BaseException, float]:
    began = time.monotonic()
    with pytest.raises(Exception) as caught:
        fs.pipe_file("some-bucket/k", b"x")
    return caught.value, time.monotonic() - began


def test_an_unreachable_endpoint_raises_endpoint_connection_error(closed_port_env, monkeypatch):
    # botocore's retries key `max_attempts` counts RETRIES (so 1 = two tries, with a random back-off
    # of up to 1 s); `total_max_attempts` (or AWS_MAX_ATTEMPTS) counts tries. s3fs's own `retries`
    # (an attribute: S3FileSystem(retries=1) is a TypeError) does not apply to connection errors.
    fast = {"connect_timeout": 2, "read_timeout": 5, "retries": {"total_max_attempts": 1}}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=fast)
    fs.retries = 1
    error, seconds = failure(fs)
    assert type(error) is botocore.exceptions.EndpointConnectionError
    assert not isinstance(error, OSError)
    assert str(error) == f'Could not connect to the endpoint URL: "{closed_port_env}/some-bucket/k"'
    assert seconds < ONE_TRY_S

    with pytest.raises(TypeError, match="unexpected keyword argument 'retries'"):
        s3fs.S3FileSystem(skip_instance_cache=True, retries=1).ls("some-bucket")

    # env only (what a trainer subprocess gets): AWS_MAX_ATTEMPTS=1 is one try
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    error, seconds = failure(s3fs.S3FileSystem(skip_instance_cache=True))
    assert type(error) is botocore.exceptions.EndpointConnectionError
    assert seconds < ONE_TRY_S


@pytest.mark.skipif(not os.environ.get("S3_SLOW_TESTS"), reason="about 10 s; set S3_SLOW_TESTS=1")
def test_an_unreachable_endpoint_with_default_settings_takes_seconds(closed_port_env):
    """With no settings botocore (legacy mode, 5 tries, back-off) takes about 7-12 s to give up."""
    error, seconds = failure(s3fs.S3FileSystem(skip_instance_cache=True))
    assert type(error) is botocore.exceptions.EndpointConnectionError
    assert 3 < seconds < 30, seconds
