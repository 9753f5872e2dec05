"""Shared helpers: run the real CLI in a subprocess, on temporary directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from s3server import SeaweedServer

REPO = Path(__file__).resolve().parent.parent
FINAL = "step-00000064"


def run_cli(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` (or `python compare.py ...` when args start with compare.py)."""
    command = [sys.executable, *map(str, args)] if str(args[0]).endswith(".py") else \
        [sys.executable, "-m", "trainer", *map(str, args)]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def train(output: Path, *args, expect: int = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    result = run_cli("--output", output, *args, env=env)
    assert result.returncode == expect, f"exit {result.returncode}, wanted {expect}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def compare(a: Path, b: Path, *args) -> subprocess.CompletedProcess:
    return run_cli(REPO / "compare.py", a, b, *args)


def generation(output: Path, name: str = FINAL) -> Path:
    return output / "checkpoints" / name


def attempts(output: Path) -> list[dict]:
    folders = sorted((output / "attempts").iterdir())
    return [json.loads((f / "attempt.json").read_text()) for f in folders]


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The stderr of a failed run must be exactly one line, with no traceback."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> Path:
    """An uninterrupted default run, shared by every test that compares against it."""
    output = tmp_path_factory.mktemp("baseline") / "run"
    train(output)
    return output


# -- a real S3 server (SeaweedFS) for the object-store tests ---------------------------------------

# Variables a developer's shell may carry that would change or break what boto3/s3fs do here.
INHERITED_AWS = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_CA_BUNDLE")


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
        server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
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
