"""A small local Polyaxon agent: runs a server's queued runs as processes on this machine.

Polyaxon 2.18 has no agent for this: `polyaxon agent` accepts only `--kind k8s`, and its process
executor (polyaxon/_local_process/executor.py) reads `V1Container.image`, which does not exist,
builds docker's argument list, and applies no env or workingDir. What it has that works is the
converter. This agent takes each queued run, converts it with Polyaxon's own process converter
(trainer/integrations/polyaxon/internals.py), and starts each container in turn, init steps
first, as a process: its command and args, its env on top of the agent's, in its workingDir.
It then posts the run's statuses: `starting` when it takes a run, `running` before the main
container, and at the end the status the exit code means (0 succeeded, 75 stopped: resumable,
anything else failed), unless the job posted a final status itself (the server keeps the first
final status it receives).

Executors, as the trainer sees them:
- `process` (default): as Polyaxon's process converter sets it, POLYAXON_HAS_PROCESS_SIDECAR=true:
  the job's tracking uploads its own artifacts and the trainer posts its own final status.
- `k8s`: POLYAXON_HAS_PROCESS_SIDECAR removed, as in a Kubernetes pod: the job posts no status and
  the agent decides, as Polyaxon's Kubernetes agent does from the pod's exit.

What it ignores, by design: resources, retries (`maxRetries`, `podFailurePolicy`), node
selection, the image (every container runs with this machine's Python and PATH), volumes
other than emptyDir (an emptyDir becomes a fresh folder per run: its mountPath is rewritten in
the container's env, args and workingDir), and the sidecar container (with `--sidecar-delay-secs`
it copies the run's context artifacts to the store once, that long after the main container
started, as a late sidecar sync would).

Every run's output goes to `<root>/logs/<run uuid>.log`; what it decided, one JSON line per
run, to `<root>/agent.jsonl` (the tests read it).

    python -m trainer.integrations.polyaxon.local_agent --root DIR --store JSON [--executor k8s]

POLYAXON_HOST names the server; POLYAXON_CONTEXT_ROOT (required) the context root, the same as
the server's: the server resolves some of a run's paths under it, the converter the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from trainer.integrations.polyaxon.retries import call

log = logging.getLogger("local_agent")

EXIT_STATUS = {0: "succeeded", 75: "stopped"}
"""The final status an exit code means; any other exit is `failed`."""
FINAL = frozenset({"succeeded", "failed", "stopped", "skipped", "upstream_failed", "done"})


def status_of_exit(exit_code: int) -> str:
    return EXIT_STATUS.get(exit_code, "failed")


@dataclass
class AgentOptions:
    root: Path
    store: dict
    """The artifacts store connection (as the sandbox's POLYAXON_AGENT_ARTIFACTS_STORE)."""
    owner: str = "default"
    project: str | None = None
    """Only this project's runs (None: every project of the owner)."""
    executor: str = "process"
    sidecar_delay_s: float | None = None
    poll_s: float = 0.5


@dataclass
class LocalAgent:
    options: AgentOptions
    started: set[str] = field(default_factory=set)
    """Runs being executed now (a resumed run is queued again later, with the same uuid)."""
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self):
        from polyaxon.client import PolyaxonClient

        return PolyaxonClient()

    def queued(self) -> list[tuple[str, str]]:
        """(project, run uuid) of every queued run of the owner."""
        api = self.client()
        projects = [self.options.project] if self.options.project else \
            [p.name for p in call(api.projects_v1.list_projects, self.options.owner, limit=100).results or []]
        found = []
        for project in projects:
            runs = call(api.runs_v1.list_runs, self.options.owner, project, query="status:queued",
                        limit=100).results or []
            found += [(project, run.uuid) for run in runs if run.uuid not in self.started]
        return found

    def serve(self) -> None:
        while not self.stopping.is_set():
            try:
                for project, run_uuid in self.queued():
                    self.started.add(run_uuid)
                    threading.Thread(target=self.execute, args=(project, run_uuid), daemon=True).start()
            except Exception as error:  # noqa: BLE001 - the server may be starting or busy: poll again
                log.warning("local agent: polling failed: %s: %s", error.__class__.__name__, error)
            self.stopping.wait(self.options.poll_s)

    # ------------------------------------------------------------------ one run
    def post(self, project: str, run_uuid: str, status: str, reason: str, message: str | None = None) -> None:
        from polyaxon.schemas import V1StatusCondition

        condition = V1StatusCondition.get_condition(type=status, status="True", reason=reason, message=message)
        call(self.client().runs_v1.create_run_status, self.options.owner, project, run_uuid,
             body={"condition": condition.to_dict()})

    def status(self, project: str, run_uuid: str) -> str:
        return str(call(self.client().runs_v1.get_run, self.options.owner, project, run_uuid).status)

    def execute(self, project: str, run_uuid: str) -> None:
        record = {"run": run_uuid, "project": project, "executor": self.options.executor}
        try:
            self.post(project, run_uuid, "starting", "LocalAgent", "the local agent took the run")
            run = call(self.client().runs_v1.get_run, self.options.owner, project, run_uuid)
            record.update(self.run_containers(project, run))
        except Exception as error:  # noqa: BLE001 - a run the agent cannot start fails, saying why
            record["error"] = f"{error.__class__.__name__}: {error}"
            log.warning("local agent: run %s: %s", run_uuid, record["error"])
            try:
                self.post(project, run_uuid, "failed", "LocalAgentError", record["error"][:500])
            except Exception:  # noqa: BLE001 - the record below still says what happened
                pass
        with self.lock, (self.options.root / "agent.jsonl").open("a") as events:
            events.write(json.dumps(record) + "\n")
        self.started.discard(run_uuid)

    def run_containers(self, project: str, run) -> dict:
        from trainer.integrations.polyaxon.internals import PROCESS_SIDECAR_ENV, convert_run

        containers = convert_run(self.options.owner, project, run.name, run.uuid, run.content, self.options.store)
        folders = self.empty_dirs(run)
        logs = self.options.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        home = self.options.root / "homes" / run.uuid
        home.mkdir(parents=True, exist_ok=True)
        *init, main = containers
        with (logs / f"{run.uuid}.log").open("a") as output:
            for container in init:
                code = self.start(container, folders, home, output, {"POLYAXON_SERVICE": "init"}).wait()
                if code != 0:
                    self.post(project, run.uuid, "failed", "InitFailed", f"{container.name} exited {code}")
                    return {"init_exit": code, "posted": "failed"}
            self.post(project, run.uuid, "running", "LocalAgent", "the main container started")
            drop = {PROCESS_SIDECAR_ENV} if self.options.executor == "k8s" else set()
            process = self.start(main, folders, home, output, {}, drop)
            sidecar = None
            if self.options.sidecar_delay_s is not None:
                sidecar = threading.Timer(self.options.sidecar_delay_s, self.sidecar_copy, args=(run.uuid,))
                sidecar.start()
            code = process.wait()
            if sidecar is not None:
                sidecar.join()
        at_exit = self.status(project, run.uuid)
        record = {"exit": code, "status_at_exit": at_exit, "posted": None}
        if at_exit not in FINAL:
            record["posted"] = status_of_exit(code)
            self.post(project, run.uuid, record["posted"], f"Exit{code}", f"the main container exited {code}")
        return record

    def empty_dirs(self, run) -> dict[str, str]:
        """mountPath → a fresh folder, for each emptyDir the main container mounts."""
        content = json.loads(run.content)
        spec = content.get("run") or {}
        empty = {v["name"] for v in spec.get("volumes") or [] if "emptyDir" in v}
        mounts = (spec.get("container") or {}).get("volumeMounts") or []
        folders = {}
        for mount in mounts:
            if mount.get("name") in empty:
                folder = self.options.root / "volumes" / run.uuid / mount["name"]
                folder.mkdir(parents=True, exist_ok=True)
                folders[mount["mountPath"].rstrip("/")] = str(folder)
        return folders

    def start(self, container, folders: dict[str, str], home: Path, output, extra: dict,
              drop: set[str] = frozenset()) -> subprocess.Popen:
        def local(value: str) -> str:
            for mount_path, folder in folders.items():
                if value == mount_path or value.startswith(mount_path + "/"):
                    return folder + value[len(mount_path):]
            return value

        env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "POLYAXON_SERVICE")}
        env["HOME"] = str(home)
        for variable in container.env or []:
            pairs = variable.get_root()
            name, value = (pairs["name"], pairs.get("value")) if isinstance(pairs, dict) and "name" in pairs \
                else (pairs if isinstance(pairs, tuple) else next(iter(pairs.items())))
            if value is not None:
                env[name] = local(str(value))
        env.update(extra)
        for name in drop:
            env.pop(name, None)
        command = [local(str(part)) for part in (container.command or []) + (container.args or [])]
        cwd = local(container.working_dir) if container.working_dir else str(home)
        if not Path(cwd).is_dir():  # an image's folder (e.g. /opt/...) is not on this machine
            raise FileNotFoundError(f"{container.name}: workingDir {cwd} does not exist on this machine")
        output.write(f"--- {container.name}: {' '.join(command)[:300]}\n")
        output.flush()
        return subprocess.Popen(command, env=env, cwd=cwd, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def sidecar_copy(self, run_uuid: str) -> None:
        """What a late sidecar sync does: the run's context artifacts, copied to the run's
        folder in the artifacts store (a host path here; a bucket through fsspec)."""
        from trainer.integrations.polyaxon.internals import synced_context

        source = synced_context() / run_uuid
        if not source.is_dir():
            return
        schema = self.options.store.get("schema") or {}
        if self.options.store.get("kind") == "host_path":
            shutil.copytree(source, Path(schema["mountPath"]) / run_uuid, dirs_exist_ok=True)
        else:
            import fsspec

            bucket = schema["bucket"].rstrip("/")
            filesystem, _ = fsspec.core.url_to_fs(bucket)
            filesystem.put(str(source) + "/", f"{bucket}/{run_uuid}/", recursive=True)
        with self.lock, (self.options.root / "agent.jsonl").open("a") as events:
            events.write(json.dumps({"run": run_uuid, "sidecar_copy": str(source)}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="local_agent", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--root", type=Path, required=True, help="folder for logs, homes and emptyDir volumes")
    parser.add_argument("--store", required=True, help="the artifacts store connection, JSON")
    parser.add_argument("--owner", default=AgentOptions.owner)
    parser.add_argument("--project", default=AgentOptions.project, help="only this project's runs")
    parser.add_argument("--executor", choices=("process", "k8s"), default=AgentOptions.executor)
    parser.add_argument("--sidecar-delay-secs", type=float, default=AgentOptions.sidecar_delay_s)
    parser.add_argument("--poll-secs", type=float, default=AgentOptions.poll_s)
    args = parser.parse_args(argv)
    if not os.environ.get("POLYAXON_CONTEXT_ROOT"):
        parser.error("set POLYAXON_CONTEXT_ROOT to a folder of this machine, the same as the server's: the runs' "
                     "context paths are resolved under it (the default, /plx-context, is a pod's)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.root.mkdir(parents=True, exist_ok=True)
    agent = LocalAgent(AgentOptions(args.root, json.loads(args.store), args.owner, args.project, args.executor,
                                    args.sidecar_delay_secs, args.poll_secs))
    signal.signal(signal.SIGTERM, lambda *_: agent.stopping.set())
    agent.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
