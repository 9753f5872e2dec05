"""`make polyaxon-demo`: the bundle's three commands against Polyaxon's own server, on this machine.

Starts the sandbox (haupt, from .venv-sandbox) and the local agent (local_agent.py), then runs,
with the bundle's own files and the real `polyaxon` CLI:

    polyaxon run -f polyaxonfiles/polyaxonfile.yaml -u -P interrupt_at_step=27   # stops at 27
    polyaxon ops resume -uid U -f presets/resume.yaml                             # continues U
    polyaxon ops restart -uid U --copy                                            # a new run from U

and prints each run's uuid, final status and the generation it restored. Everything lives under
`--root` (default outputs-polyaxon-demo/, replaced on every run); the server and the agent stop
at the end, or with `--keep` (`make polyaxon-demo KEEP=1`) stay up, the UI serving each run's
page at the printed address, until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
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
        last = (result.stdout + result.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"polyaxon-demo: `polyaxon {' '.join(command)}` exited {result.returncode}: {last[0]}; "
                         f"see {sandbox.root / 'server.log'}")
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
    parser.add_argument("--keep", action="store_true",
                        help="leave the server up afterwards (its UI shows the runs) until Ctrl-C or SIGTERM")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if not args.sandbox.is_file():
        parser.error(f"no Polyaxon sandbox at {args.sandbox}: run `make polyaxon-demo` (it installs "
                     f"requirements-sandbox.txt into .venv-sandbox)")
    shutil.rmtree(args.root, ignore_errors=True)
    sandbox = Sandbox(args.root, args.sandbox)
    log.info("starting Polyaxon's server (haupt sandbox) under %s ...", sandbox.root)
    try:
        sandbox.start()
    except RuntimeError as error:
        raise SystemExit(f"polyaxon-demo: {error}") from None
    log.info("server at %s (UI: %s)", sandbox.host, project_page(sandbox))
    home = sandbox.root / "home"
    agent = sandbox.agent(sandbox.root / "agent", PROJECT)
    try:
        if sandbox.cli(home, "project", "create", "--name", PROJECT).returncode != 0:
            raise SystemExit(f"polyaxon-demo: could not create project {PROJECT}; see {sandbox.root}/server.log")
        run = step(sandbox, agent, home, "run -u, interrupted at step 27", "run", "-p", PROJECT, "-f",
                   "polyaxonfiles/polyaxonfile.yaml", "-u", "-P", "interrupt_at_step=27")
        step(sandbox, agent, home, "ops resume, same run", "ops", "resume", "-p", PROJECT, "-uid", run,
             "-f", "presets/resume.yaml")
        copy = step(sandbox, agent, home, "ops restart --copy, a new run", "ops", "restart", "-p", PROJECT,
                    "-uid", run, "--copy")
        log.info("run directories: %s; job logs: %s", sandbox.artifacts / "training-recovery",
                 sandbox.root / "agent" / "logs")
        if args.keep:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C in a terminal reaches make and this process
                signal.signal(sig, lambda *_: stop.set())
            log.info("the server stays up; its UI:\n  original and resumed run: %s\n  its copy: %s\n"
                     "stop: Ctrl-C, or kill %d", run_page(sandbox, run), run_page(sandbox, copy), os.getpid())
            sys.stdout.flush()
            while not stop.wait(0.5):
                if sandbox.process is None or sandbox.process.poll() is not None:
                    raise SystemExit(f"polyaxon-demo: the server exited; see {sandbox.root / 'server.log'}")
            log.info("stopping the server")
    finally:
        agent.stop()
        sandbox.stop()
    return 0


def project_page(sandbox: Sandbox) -> str:
    return f"{sandbox.host}/ui/default/{PROJECT}/runs"


def run_page(sandbox: Sandbox, run_uuid: str) -> str:
    return f"{sandbox.host}/ui/default/{PROJECT}/runs/{run_uuid}"


if __name__ == "__main__":
    sys.exit(main())
