"""Every Polyaxon (2.18.0) and traceml (1.5.0) internal the trainer and the local agent lean on.

Like trainer/compat.py: each name is resolved here, with the version it was checked against,
and tests/test_polyaxon_live.py resolves every one, so an upgrade that moves one fails with a
line naming it and this file instead of a job going wrong on a server.

- The local agent (local_agent.py) converts a queued run with Polyaxon's own process converter
  (the compiled operation → init and main containers: command, args, env, workingDir), and
  needs the context root the converter wrote its paths under.
- The tracking (tracking.py) replaces traceml's forced exit handler under a process sidecar
  (`_end`, which calls `log_succeeded()` whatever the exit code) by the flush-only `_wait`.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass

from trainer.compat import PrivateApiMoved, PrivateName, installed_version
from trainer.integrations.polyaxon.retries import call


@dataclass(frozen=True)
class PolyaxonName(PrivateName):
    listed_in = "trainer/integrations/polyaxon/internals.py"


PROCESS_EXECUTOR = PolyaxonName(
    "polyaxon._local_process.executor", "Executor", "polyaxon", "2.18.0",
    "converting a queued run into the containers a process agent starts (Executor.convert)")
AGENT_CONFIG = PolyaxonName(
    "polyaxon._schemas.agent", "AgentConfig", "polyaxon", "2.18.0",
    "handing the converter the artifacts store the sandbox uses")
CONTEXT_PATHS = PolyaxonName(
    "polyaxon._contexts", "paths", "polyaxon", "2.18.0",
    "the context root (POLYAXON_CONTEXT_ROOT) the run's artifacts path and the sidecar's copy live under")
TRACKING_RUN = PolyaxonName(
    "traceml.tracking.run", "Run", "traceml", "1.5.0",
    "replacing the forced `_end` exit handler (log_succeeded) of a run with a process sidecar")
PRIVATE_NAMES = (PROCESS_EXECUTOR, AGENT_CONFIG, CONTEXT_PATHS, TRACKING_RUN)

PROCESS_SIDECAR_ENV = "POLYAXON_HAS_PROCESS_SIDECAR"
"""Set by the docker and process converters (polyaxon._env_vars.keys, checked against 2.18.0)."""
CONTEXT_ROOT_ENV = "POLYAXON_CONTEXT_ROOT"
"""Read by polyaxon._contexts.paths at import (checked against 2.18.0); default /plx-context."""


def synced_context():
    """What the sidecar uploads, and mirrors deletions of: `<context root>/artifacts`."""
    from pathlib import Path

    return Path(CONTEXT_PATHS.resolve().CONTEXT_MOUNT_ARTIFACTS)


def convert_run(owner: str, project: str, run_name: str, run_uuid: str, content: str, artifacts_store: dict):
    """The containers (init steps first, the main container last) the process executor would
    start for this compiled operation, each with name, command, args, env and working_dir."""
    from polyaxon import settings

    config = AGENT_CONFIG.resolve().read({"artifactsStore": artifacts_store, "namespace": "sandbox"})
    settings.set_agent_config(config)  # the converter reads the agent's defaults from there
    executor = PROCESS_EXECUTOR.resolve()
    return executor.convert(owner_name=owner, project_name=project, run_name=run_name, run_uuid=run_uuid,
                            content=content, default_auth=False, agent_content=config.to_json())


def flush_only_at_exit(run) -> None:
    """traceml registers `_end` (log_succeeded, then flush) as the exit handler of a run with a
    process sidecar; keep the flush and the artifacts sync, drop the status: the trainer posts
    the one its exit code means (tracking.py)."""
    klass = TRACKING_RUN.resolve()
    for name in ("_exit_handler", "_wait", "_register_exit_handler"):
        if not hasattr(klass, name) and not hasattr(run, name):
            raise PrivateApiMoved(f"traceml.tracking.run.Run.{name} is gone (traceml {installed_version('traceml')} "
                                  f"installed, checked against 1.5.0); it is used for the exit status under a "
                                  f"process sidecar: update trainer/integrations/polyaxon/internals.py")
    handler = getattr(run, "_exit_handler", None)
    if handler is not None:
        atexit.unregister(handler)
    run._register_exit_handler(lambda: run._wait(sync_artifacts=True))


def answered_before_the_next(run) -> None:
    """The client posts each lineage reference (`log_artifact_ref` and `log_model_ref` call
    `log_artifact_lineage`) and each status (`log_status`, under `log_failed`, `log_stopped`,
    `log_succeeded`: `create_run_status`) in the background, with `async_req=True`, where the
    sandbox's spurious 405 loses it without a word (a run left `running` after its trainer
    posted `failed`). This run's posts go through `retries.call` instead, each answered before
    the next."""
    lineage = run.log_artifact_lineage

    def lineage_answered(body, async_req: bool = True):
        return call(lineage, body=body, async_req=False)

    runs = run.client.runs_v1  # created once per client, then kept
    status = runs.create_run_status

    def status_answered(*args, async_req: bool = True, **kwargs):
        return call(status, *args, async_req=False, **kwargs)

    run.log_artifact_lineage = lineage_answered
    runs.create_run_status = status_answered
