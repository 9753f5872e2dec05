"""Polyaxon's own server (`haupt sandbox`, pinned in requirements-sandbox.txt) and the project's
local agent on this machine, for `make polyaxon-demo` and the live tests (tests/test_polyaxon_live.py).

    sandbox = Sandbox(root, haupt)              # on a free loopback port, its own root
    sandbox.start()                             # about 5-25 s: migrations, then /healthz answers
    agent = sandbox.agent(folder, project="p")  # our agent (local_agent.py), this project only
    result = sandbox.cli(home, "run", "-p", "p", "-f", ...)   # the real `polyaxon` CLI
    agent.stop(); sandbox.stop()

The server runs from its own venv (.venv-sandbox: its fsspec pin conflicts with s3fs's); the
CLI, the agent and the jobs run with this interpreter's venv. With `store` (a bucket
connection) the sandbox's artifacts store is that bucket; by default it is a host path.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
"""The repository (the polyaxonfiles, presets and code a run uploads)."""
BIN = Path(sys.executable).parent
UUID = re.compile(r"\b[0-9a-f]{32}\b")
SPURIOUS_405 = ("Status: 405", "Method Not Allowed")
CREATED = "A new run was created"
UNAPPROVED = re.compile(r"/api/v1/([-\w]+)/([-\w]+)/runs/(\w+)/approve")
"""The approval a spurious 405 refused, in the client's report: owner, project, run uuid."""
UI_OFFLINE = {"POLYAXON_UI_IN_SANDBOX": "true", "POLYAXON_UI_OFFLINE": "true"}
"""The server's UI from the wheel's own bundles, not the public CDNs (whose absence, or the
default static paths, leave the page blank: /static/dist/js/*.bundle.js answers 404)."""


def haupt_binary() -> Path:
    """The sandbox's `haupt`: $PLX_SANDBOX_HAUPT, else the repository's .venv-sandbox (make test)."""
    candidate = Path(os.environ.get("PLX_SANDBOX_HAUPT") or REPO / ".venv-sandbox" / "bin" / "haupt").absolute()
    if not candidate.is_file():
        raise FileNotFoundError(f"no Polyaxon sandbox at {candidate}: `make test` installs it "
                                f"(requirements-sandbox.txt into .venv-sandbox), or set PLX_SANDBOX_HAUPT")
    return candidate


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Agent:
    process: subprocess.Popen
    root: Path

    def records(self) -> list[dict]:
        path = self.root / "agent.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def log(self, run_uuid: str) -> str:
        path = self.root / "logs" / f"{run_uuid}.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Sandbox:
    root: Path
    haupt: Path
    store: dict | None = None
    """A bucket artifacts store connection; None: a host path under root."""
    environment: dict[str, str] = field(default_factory=dict)
    """Extra variables for the server, the agents and their jobs (a bucket's credentials)."""
    port: int = 0
    process: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        # Absolute before any Popen(cwd=...): `make polyaxon-demo` passes .venv-sandbox/bin/haupt,
        # relative to the caller's directory, and the server starts with cwd=root.
        self.root, self.haupt = self.root.absolute(), self.haupt.absolute()

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def context_root(self) -> Path:
        """POLYAXON_CONTEXT_ROOT of the server and of every agent: the server resolves the
        run's paths (`globals.run_artifacts_path`, the copy's init step) under it, and the
        agent's converter the rest; they must agree, and never be the host's /plx-context."""
        return self.root / "plx-context"

    @property
    def artifacts_store(self) -> dict:
        if self.store is not None:
            return self.store
        path = str(self.artifacts)
        return {"name": "artifacts_store", "kind": "host_path", "schema": {"hostPath": path, "mountPath": path}}

    def base_env(self, home: Path) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items()
               if not name.startswith("POLYAXON_") and name != "PYTHONPATH"}
        env.update(self.environment)
        env.update(HOME=str(home), POLYAXON_HOST=self.host, POLYAXON_CONTEXT_ROOT=str(self.context_root), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
                   POLYAXON_NO_OP="false", POLYAXON_DISABLE_ANALYTICS="true",
                   MPLCONFIGDIR=str(self.root / "matplotlib"))  # one font cache, not one per job's HOME
        return env

    def start(self, timeout: float = 120) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.artifacts.mkdir(exist_ok=True)
        self.port = free_port()
        home = self.root / "server-home"
        home.mkdir(exist_ok=True)
        env = self.base_env(home)
        env["POLYAXON_AGENT_ARTIFACTS_STORE"] = json.dumps(self.artifacts_store)
        env.update(UI_OFFLINE)
        log = (self.root / "server.log").open("ab")
        self.process = subprocess.Popen(
            [str(self.haupt), "sandbox", "start", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--path", str(self.root / "server")], env=env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the Polyaxon sandbox exited {self.process.returncode}; see {self.root}/server.log")
            try:
                with urllib.request.urlopen(f"{self.host}/healthz", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Polyaxon sandbox did not answer within {timeout:.0f} s; see {self.root}/server.log")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def agent(self, root: Path, project: str, executor: str = "process", sidecar_delay_s: float | None = None) -> Agent:
        """Our local agent for `project`'s runs (its logs, homes and volumes under `root`)."""
        root.mkdir(parents=True, exist_ok=True)
        env = self.base_env(root / "agent-home")
        command = [sys.executable, "-m", "trainer.integrations.polyaxon.local_agent", "--root", str(root),
                   "--store", json.dumps(self.artifacts_store), "--project", project, "--executor", executor]
        if sidecar_delay_s is not None:
            command += ["--sidecar-delay-secs", str(sidecar_delay_s)]
        log = (root / "agent.log").open("ab")
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        return Agent(process, root)

    def cli(self, home: Path, *args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
        """The real `polyaxon` CLI against this server, with `home` as HOME (its CLI cache).

        The sandbox (haupt 2.18, one uvicorn worker) answers about 2% of POSTs with a Django
        `405 Method Not Allowed` that never reached a view: nothing was created or changed, and
        the same request succeeds when repeated. Such a command is run again, unless it got as
        far as creating a run (`polyaxon run` then uploads: repeating it would make a second run).
        `run -u` whose last step, the approval after the upload, met the 405 has its run
        approved the way a user would: `polyaxon ops approve`, itself retried."""
        home.mkdir(parents=True, exist_ok=True)
        for _ in range(4):
            result = subprocess.run([str(BIN / "polyaxon"), *args], env=self.base_env(home), cwd=cwd,
                                    capture_output=True, text=True, timeout=timeout)
            output = result.stdout + result.stderr
            if result.returncode != 0 and all(s in output for s in SPURIOUS_405) and CREATED in output:
                return self.approve_after_upload(home, result, cwd, timeout)
            if result.returncode == 0 or not all(s in output for s in SPURIOUS_405):
                return result
            time.sleep(0.5)
        return result

    def approve_after_upload(self, home: Path, created: subprocess.CompletedProcess, cwd: Path,
                             timeout: float) -> subprocess.CompletedProcess:
        """`created` made and uploaded a run whose approval met the spurious 405: approve it
        again (`ops approve`); the result reads as `created`'s, with the approval's output."""
        unapproved = UNAPPROVED.search(created.stdout + created.stderr)
        if unapproved is None:
            return created
        owner, project, run_uuid = unapproved.groups()
        approved = self.cli(home, "ops", "approve", "-p", f"{owner}/{project}", "--uid", run_uuid,
                            cwd=cwd, timeout=timeout)
        return subprocess.CompletedProcess(created.args, approved.returncode, created.stdout + approved.stdout,
                                           created.stderr + approved.stderr)

    def run(self, project: str, run_uuid: str, owner: str = "default") -> dict:
        """The run as the REST API gives it (status, original, inputs, ...), retried on the
        sandbox's spurious 405 (see `cli`)."""
        return self.get(f"/api/v1/{owner}/{project}/runs/{run_uuid}")

    def lineage(self, project: str, run_uuid: str, owner: str = "default") -> dict[str, dict]:
        """The run's artifact lineage by name."""
        answer = self.get(f"/api/v1/{owner}/{project}/runs/{run_uuid}/lineage/artifacts")
        return {entry["name"]: entry for entry in answer.get("results") or []}

    def get(self, path: str) -> dict:
        """GET an API path, retried on the sandbox's spurious 405 (see `cli`)."""
        url = f"{self.host}{path}"
        for attempt in range(5):
            try:
                with urllib.request.urlopen(url, timeout=10) as answer:
                    body = answer.read()
                    # the lineage endpoints answer gzip whatever the request accepts
                    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)
            except urllib.error.HTTPError as error:
                if error.code != 405 or attempt == 4:
                    raise
                time.sleep(0.3)
        raise AssertionError("unreachable")

    def wait_for_status(self, project: str, run_uuid: str, statuses: set[str], timeout: float = 240) -> str:
        """The run's status once it is one of `statuses` (a final one, usually)."""
        deadline, status = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            status = self.run(project, run_uuid).get("status")
            if status in statuses:
                return status
            time.sleep(0.5)
        raise TimeoutError(f"run {run_uuid} is {status} after {timeout:.0f} s, not one of {sorted(statuses)}")


def run_uuid_of(result: subprocess.CompletedProcess) -> str:
    match = UUID.search(result.stdout + result.stderr)
    assert match, f"no run uuid in the CLI's output:\n{result.stdout}\n{result.stderr}"
    return match.group(0)
