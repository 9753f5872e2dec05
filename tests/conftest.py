"""Shared test helpers, in this one module (test files import them from here, never from
each other): run the real CLI in a subprocess on temporary directories, start a live trainer,
wait for its lines, the shared baselines, a real S3 server, and a fresh clone of the tree for
the README's make targets.

Every wall-clock limit in tests/ goes through `scaled()`: the limits are generous (they catch
a hang, they do not measure speed), and `TEST_TIMEOUT_SCALE` (default 1) multiplies all of
them for a slow or loaded machine. Tests wait for progress (a line, a file, a count of
kills), never for a fixed time.
"""

from __future__ import annotations

import functools
import gc
import json
import resource
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from forking import Zygote, forkable
from s3server import SeaweedServer

REPO = Path(__file__).resolve().parent.parent
FINAL = "step-00000064"
SHORT = ("--epochs", 3)
"""A 24-step run (3 epochs of the default workload): what `short_baseline` trains."""
SHORT_FINAL = "step-00000024"
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT_SCALE_ENV = "TEST_TIMEOUT_SCALE"
CLI_TIMEOUT_S = 600
"""One CLI run (a few seconds on an idle machine): only a hang reaches it."""


def timeout_scale(environ=os.environ) -> float:
    text = environ.get(TIMEOUT_SCALE_ENV, "1")
    try:
        scale = float(text)
    except ValueError:
        scale = 0
    if not scale > 0:
        raise pytest.UsageError(f"{TIMEOUT_SCALE_ENV}={text!r}: give a positive number (e.g. 3 on a loaded machine)")
    return scale


TIMEOUT_SCALE = timeout_scale()


def scaled(seconds: float) -> float:
    """A wall-clock limit of the tests, times TEST_TIMEOUT_SCALE."""
    return seconds * TIMEOUT_SCALE


def trainer_env(env: dict | None = None) -> dict:
    """The environment of a trainer subprocess: ours, the repository importable, unbuffered
    output (a test reads progress lines as they come), then `env`."""
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}


def run_cli(*args, env: dict | None = None, timeout: float = CLI_TIMEOUT_S, **options) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` (or `python compare.py ...` when args start with compare.py);
    `options` go to subprocess.run (preexec_fn, ...)."""
    argv = [*map(str, args)] if str(args[0]).endswith(".py") else ["-m", "trainer", *map(str, args)]
    environment = trainer_env(env)
    if not forked(environment, options):
        return subprocess.run([sys.executable, *argv], cwd=REPO, env=environment, capture_output=True, text=True,
                              timeout=scaled(timeout), **options)
    with zygote().spawn(argv, REPO, environment, new_session=False) as process:
        try:
            out, err = process.communicate(timeout=scaled(timeout))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def start(output, *args, env: dict | None = None, command: tuple = (sys.executable, "-m", "trainer"),
          fresh: bool = False, **options) -> subprocess.Popen:
    """The trainer (or `command`, e.g. torchrun ... -m trainer) on `output` as a live process
    with a progress line per step, arriving unbuffered; `options` go to Popen
    (start_new_session, ...). `fresh`: a fresh interpreter, never a fork of the zygote (a test
    of start-up itself)."""
    rest = ["--output", str(output), "--log-every-steps", "1", *map(str, args)]
    environment = trainer_env(env)
    if not fresh and tuple(command) == TRAINER and forked(environment, {**options, "start_new_session": False}):
        return zygote().spawn(["-m", "trainer", *rest], REPO, environment,
                              new_session=options.get("start_new_session", False))
    return subprocess.Popen([*map(str, command), *rest], cwd=REPO, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **options)


TRAINER = (sys.executable, "-m", "trainer")
FORK_ENV = "TEST_FORK"


def forked(environment: dict, options: dict) -> bool:
    """Whether a trainer or compare.py run is forked from the worker's zygote (tests/forking.py)
    rather than started as a fresh interpreter: unless TEST_FORK=0, a `preexec_fn` (or another
    Popen option) is asked for, or the environment differs in what torch reads at import."""
    return (os.environ.get(FORK_ENV, "1") != "0" and not any(options.values())
            and forkable(environment, zygote_environment()))


def zygote_environment() -> dict:
    return trainer_env()


@functools.cache
def zygote() -> Zygote:
    """This worker's zygote, started on first use; it ends with the worker."""
    return Zygote(sys.executable, REPO, zygote_environment())


def wait_for_line(process: subprocess.Popen, prefix: str) -> str:
    """Read the process's stdout up to the first line starting with `prefix` (progress, not
    time: the line comes when the trainer gets there, however slow the machine)."""
    for line in process.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"process ended before printing {prefix!r}: {process.stderr.read()}")


def finish(process: subprocess.Popen, timeout: float = CLI_TIMEOUT_S) -> tuple[str, str]:
    """The rest of a live process's output once it exited (killed if it hangs past the limit)."""
    try:
        return process.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def wait_until(condition, what: str, timeout: float = CLI_TIMEOUT_S, every: float = 0.05) -> None:
    """Poll `condition` until it holds; fail naming `what` if the (scaled) limit passes."""
    deadline = time.monotonic() + scaled(timeout)
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {scaled(timeout):.0f} s")
        time.sleep(every)


def train(output: Path, *args, expect: int = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    result = run_cli("--output", output, *args, env=env)
    assert result.returncode == expect, f"exit {result.returncode}, wanted {expect}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def compare(a: Path, b: Path, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli(REPO / "compare.py", a, b, *args, env=env)


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


def png_size(path) -> tuple[int, int]:
    """Width and height from the PNG header (signature, then the IHDR chunk)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def clean_environment(**extra: str) -> dict:
    """Our environment without launcher variables from an outer launcher."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PET_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


TORCHRUN_CHILD_FAILED = 1
"""What torchrun itself exits with when any child exits non-zero, 75 included (measured)."""


def torchrun(output, *args, nproc: int = 2, expect: int = 0, env: dict | None = None,
             tmp: Path) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC -m trainer --output OUTPUT --threads 1 ARGS`;
    `expect` is the trainer's status (every rank's), read from TRAINER_EXIT_STATUS_FILE;
    torchrun's own status must be 0 for 0 and 1 for anything else."""
    status_file = tmp / f"status-{len(list(tmp.glob('status-*')))}"
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), "-m", "trainer",
               "--output", str(output), "--threads", "1", *map(str, args)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=scaled(600),
                            env=clean_environment(TRAINER_EXIT_STATUS_FILE=str(status_file), **(env or {})))
    trainer_status = int(status_file.read_text()) if status_file.exists() else None
    assert trainer_status == expect, (f"trainer status {trainer_status}, wanted {expect} (torchrun {result.returncode})\n"
                                      f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    assert result.returncode == (0 if expect == 0 else TORCHRUN_CHILD_FAILED), result.stderr[-3000:]
    return result


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A folder `make(folder)` fills once per pytest session, shared by every xdist worker: the
    first worker that asks makes it under a file lock, the others wait for it and reuse it (a
    reference run costs every worker's CPU otherwise). Tests only read it or copy it."""
    from filelock import FileLock  # a dependency of torch

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's folder
    folder = root / f"shared-{name}"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> Path:
    """An uninterrupted default run, shared by every test that compares against it."""
    return made_once(tmp_path_factory, "baseline", lambda folder: train(folder / "run")) / "run"


@pytest.fixture(scope="session")
def short_baseline(tmp_path_factory) -> Path:
    """An uninterrupted 3-epoch local run (`SHORT`), shared by every short local and store run
    that must end equal to it."""
    return made_once(tmp_path_factory, "short-baseline", lambda folder: train(folder / "run", *SHORT)) / "run"


# -- a real S3 server (SeaweedFS) for the object-store tests ---------------------------------------
def store_env(server: SeaweedServer, **extra) -> dict:
    return {**server.env(), **extra}


def keys(server: SeaweedServer, bucket: str, prefix: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Contents", []))


def committed(server: SeaweedServer, bucket: str, run: str = "run") -> list[str]:
    return sorted(key.split("/")[2] for key in keys(server, bucket, f"{run}/checkpoints/")
                  if key.endswith("/manifest.json"))


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


# -- the Polyaxon bundle (polyaxonfiles, presets, `polyaxon check`) ---------------------------------
POLYAXON = Path(sys.executable).with_name("polyaxon")
POLYAXONFILES = sorted((REPO / "polyaxonfiles").glob("*.yaml"))
PRESETS = sorted((REPO / "presets").glob("*.yaml"))
JOB_FILE = REPO / "polyaxonfiles" / "polyaxonfile.yaml"
COMBINES = re.compile(r"^# Combines with: (.+)$", re.MULTILINE)
FLAG = re.compile(r"^(--[a-z0-9-]+)=")


def preset_targets(preset: Path) -> list[Path]:
    """The polyaxonfiles a preset says (in its `# Combines with:` line) it is meant for."""
    match = COMBINES.search(preset.read_text())
    assert match, f"{preset.name} must say at its top which polyaxonfiles it combines with"
    named = match.group(1).strip()
    if named == "every polyaxonfiles/*.yaml":
        return POLYAXONFILES
    return [REPO / name for name in named.split()]


def polyaxon_check(env: dict, files: list[Path], params: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    command = [str(POLYAXON), "check", "--strict-params"]
    for file in files:
        command += ["-f", str(file)]
    for param in params:
        command += ["-P", param]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(300))


def check_all(env: dict, cases: list[tuple[list[Path], tuple[str, ...]]]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda case: polyaxon_check(env, *case), cases))


def trainer_argv(script: str) -> list[str]:
    """The arguments after `python -m trainer` in a rendered container script."""
    tail = script.split("-m trainer", 1)[1]
    return shlex.split(re.split(r"[;&\n]", tail)[0])


# ------------------------------------------------------------------------------- a fresh clone
# A `git clone` of this tree as a new user has it, for the README's make targets
# (test_fresh_clone.py, and `make bench` in test_bench.py): the working tree's uncommitted edits
# applied, so the tree the next commit holds is what is tested; the clone reuses this checkout's
# ready venvs (symlinks), and its requirements files are dated back so that make finds the venvs'
# stamps newer and installs nothing; `make()` asserts that it did not.
VENVS = (".venv", ".venv-sandbox")
INSTALLS = ("-m venv", "pip install")


def git(*args: str, cwd: Path = REPO, **options) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, **options)


def fresh_clone(folder: Path) -> Path:
    """A fresh clone of this tree in `folder`, its venvs the ready ones."""
    git("clone", "--quiet", "--no-hardlinks", str(REPO), str(folder))
    patch = git("diff", "HEAD", "--binary").stdout
    if patch:
        git("apply", "--whitespace=nowarn", "-", cwd=folder, input=patch)
    for name in git("ls-files", "--others", "--exclude-standard", "-z").stdout.decode().split("\0"):
        if name:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, folder / name)
    for venv in VENVS:
        (folder / venv).symlink_to((REPO / venv).resolve(), target_is_directory=True)
    for requirements in folder.glob("requirements*.txt"):
        os.utime(requirements, (0, 0))  # older than the stamps: make installs nothing
    return folder


def make_env() -> dict[str, str]:
    """A user's shell: no outer make, no PYTHONPATH, no S3 or Polyaxon settings of ours."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHONPATH")
            and not k.startswith(("AWS_", "POLYAXON_"))}


def make(clone: Path, *targets: str, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(["make", *targets], cwd=clone, env=make_env(), capture_output=True, text=True,
                            timeout=scaled(timeout))
    assert result.returncode == 0, f"make {' '.join(targets)}: exit {result.returncode}\n" \
                                   f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert not any(word in result.stdout for word in INSTALLS), result.stdout[:2000]
    return result




def pytest_collection_finish(session) -> None:
    """Every test module and what it imports (torch) is loaded: frozen, the cyclic collector
    never scans them again in this long-lived worker (as the trainer does, trainer/cli.py)."""
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With TEST_CPU_LOG=FILE, each test's CPU seconds (this worker's and its finished
    subprocesses', torchrun's ranks included) are appended to FILE: what the suite's 2-core
    budget is spent on, whatever else the machine runs at the time."""
    log = os.environ.get("TEST_CPU_LOG")
    if not log:
        yield
        return
    before = cpu_seconds()
    yield
    with open(log, "a") as file:
        file.write(f"{cpu_seconds() - before:.2f} {item.nodeid}\n")


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked_children = zygote().cpu_seconds if zygote.cache_info().currsize else 0.0
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked_children
