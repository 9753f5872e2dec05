"""`make polyaxon-demo`: the bundle's three commands against Polyaxon's own server, on this machine.

Starts the sandbox (haupt, from .venv-sandbox) and the local agent (local_agent.py), then runs,
with the bundle's own files and the real `polyaxon` CLI:

    polyaxon run -f polyaxonfiles/polyaxonfile.yaml -u -P interrupt_at_step=27   # stops at 27
    polyaxon ops resume -uid U -f presets/resume.yaml                             # continues U
    polyaxon ops restart -uid U --copy                                            # a new run from U

and prints each run's uuid, final status and the generation it restored. Everything lives under
`--root` (default outputs-polyaxon-demo/, replaced on every run); the server and the agent stop
at the end. The server's UI is at the printed address while the demo runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

from trainer.integrations.polyaxon.sandbox import REPO, Sandbox, run_uuid_of

log = logging.getLogger("polyaxon-demo")
PROJECT = "training-recovery-demo"
DONE = {"succeeded", "failed", "stopped"}


def newest_attempt(run_directory: Path) -> dict:
    folders = sorted((run_directory / "attempts").iterdir()) if (run_directory / "attempts").is_dir() else []
    return json.loads((folders[-1] / "attempt.json").read_text()) if folders else {}


def wait_for_agent(agent, run_uuid: str, seen: int, timeout: float = 60) -> None:
    """Until the agent has recorded one more execution of the run than `seen`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len([r for r in agent.records() if r.get("run") == run_uuid and "sidecar_copy" not in r]) > seen:
            return
        time.sleep(0.3)


def step(sandbox: Sandbox, agent, home: Path, title: str, *command: str) -> str:
    log.info("$ polyaxon %s", " ".join(command))
    result = sandbox.cli(home, *command)
    if result.returncode != 0:
        raise SystemExit(f"polyaxon-demo: `polyaxon {' '.join(command)}` exited {result.returncode}: "
                         f"{(result.stdout + result.stderr).strip().splitlines()[-1:]}")
    run_uuid = run_uuid_of(result)
    seen = len([r for r in agent.records() if r.get("run") == run_uuid and "sidecar_copy" not in r])
    status = sandbox.wait_for_status(PROJECT, run_uuid, DONE, timeout=600)
    wait_for_agent(agent, run_uuid, seen)
    status = sandbox.run(PROJECT, run_uuid).get("status", status)
    attempt = newest_attempt(sandbox.artifacts / "training-recovery" / run_uuid)
    restored = (attempt.get("restored") or {}).get("name") or "nothing (a fresh start)"
    copied = (attempt.get("polyaxon") or {}).get("copied_from")
    extra = f", seeded from run {copied['run']} {copied['generation']}" if copied else ""
    log.info("  %s: run %s %s (exit %s), restored %s%s, last step %s", title, run_uuid, status,
             attempt.get("exit_code"), restored, extra, attempt.get("last_step"))
    return run_uuid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polyaxon-demo", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--sandbox", type=Path, default=REPO / ".venv-sandbox" / "bin" / "haupt",
                        help="the haupt executable (make installs it into .venv-sandbox)")
    parser.add_argument("--root", type=Path, default=REPO / "outputs-polyaxon-demo",
                        help="server, agent and artifacts store folder, replaced on every run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if not args.sandbox.is_file():
        parser.error(f"no Polyaxon sandbox at {args.sandbox}: run `make polyaxon-demo` (it installs "
                     f"requirements-sandbox.txt into .venv-sandbox)")
    shutil.rmtree(args.root, ignore_errors=True)
    sandbox = Sandbox(args.root.resolve(), args.sandbox)
    log.info("starting Polyaxon's server (haupt sandbox) under %s ...", args.root)
    sandbox.start()
    log.info("server at %s (UI: %s/ui/default/%s/)", sandbox.host, sandbox.host, PROJECT)
    home = sandbox.root / "home"
    agent = sandbox.agent(sandbox.root / "agent", PROJECT)
    try:
        if sandbox.cli(home, "project", "create", "--name", PROJECT).returncode != 0:
            raise SystemExit(f"polyaxon-demo: could not create project {PROJECT}; see {sandbox.root}/server.log")
        run = step(sandbox, agent, home, "run -u, interrupted at step 27", "run", "-p", PROJECT, "-f",
                   "polyaxonfiles/polyaxonfile.yaml", "-u", "-P", "interrupt_at_step=27")
        step(sandbox, agent, home, "ops resume, same run", "ops", "resume", "-p", PROJECT, "-uid", run,
             "-f", "presets/resume.yaml")
        step(sandbox, agent, home, "ops restart --copy, a new run", "ops", "restart", "-p", PROJECT, "-uid", run,
             "--copy")
        log.info("run directories: %s; job logs: %s", sandbox.artifacts / "training-recovery",
                 sandbox.root / "agent" / "logs")
    finally:
        agent.stop()
        sandbox.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
