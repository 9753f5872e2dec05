"""A real S3 server (SeaweedFS, tests/s3server.py) for the object-store tests: one per worker
(`s3_server`), a fresh bucket per test (`s3_bucket`), and readers of what a run left there."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from s3server import SeaweedServer
from support.limits import scaled

# Variables a developer's shell may carry that would change or break what boto3/s3fs do here.
INHERITED_AWS = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_CA_BUNDLE")


def store_env(server: SeaweedServer, **extra) -> dict:
    return {**server.env(), **extra}


def keys(server: SeaweedServer, bucket: str, prefix: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Contents", []))


def committed(server: SeaweedServer, bucket: str, run: str = "run") -> list[str]:
    return sorted(key.split("/")[2] for key in keys(server, bucket, f"{run}/checkpoints/")
                  if key.endswith("/manifest.json"))


@dataclass
class S3Bucket:
    """A fresh, empty bucket on the worker's SeaweedFS server (`s3_bucket` fixture)."""

    server: SeaweedServer
    name: str

    @property
    def url(self) -> str:
        """`s3://NAME`: the prefix a run's --output (or any s3fs path) starts with."""
        return f"s3://{self.name}"

    def env(self) -> dict[str, str]:
        """For `run_cli(..., env=bucket.env())` / `train(...)`: the subprocess reaches this server."""
        return self.server.env()

    def use_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this process's boto3/s3fs at the server through the environment only, with no
        inherited profile or token, and no s3fs instance cached under another environment."""
        for name in INHERITED_AWS:
            monkeypatch.delenv(name, raising=False)
        for name, value in self.env().items():
            monkeypatch.setenv(name, value)
        try:
            import s3fs
        except ImportError:
            return
        s3fs.S3FileSystem.clear_instance_cache()

    def client(self):
        """boto3 client with explicit endpoint and keys (reference reads/writes)."""
        return self.server.client()

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under `prefix`, sorted."""
        paginator = self.client().get_paginator("list_objects_v2")
        return sorted(obj["Key"] for page in paginator.paginate(Bucket=self.name, Prefix=prefix)
                      for obj in page.get("Contents", []))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> SeaweedServer:
    """One SeaweedFS server per pytest(-xdist) worker, started the first time a test asks for it.
    Tests may stop()/kill() and start() it; the next `s3_bucket` starts it again if it is down.

    For the rest of the worker's session, AWS_PROFILE & co. are removed from os.environ: env()
    points AWS_CONFIG_FILE at nothing, and with any profile named botocore then raises
    ProfileNotFound in every subprocess that `run_cli` starts with {**os.environ, **env}."""
    with pytest.MonkeyPatch.context() as patch:
        for name in INHERITED_AWS:
            patch.delenv(name, raising=False)
        server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"), start_timeout=scaled(60))
        server.start()
        yield server
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: SeaweedServer):
    """A fresh bucket (unique name) on the running server; deleted with its objects afterwards."""
    s3_server.start()  # no-op while running; brings it back after a test that left it stopped
    bucket = S3Bucket(s3_server, s3_server.create_bucket())
    yield bucket
    try:
        s3_server.start()
        s3_server.delete_bucket(bucket.name)
    except Exception:  # noqa: BLE001 - cleanup only; a broken server shows up in the next test
        pass
