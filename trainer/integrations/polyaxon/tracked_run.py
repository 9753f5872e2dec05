"""Opening the Polyaxon run that `--tracked` records into (tracking.py observes it).

Where it runs:
- *Managed* (a Polyaxon job; the agent sets POLYAXON_RUN_INSTANCE and POLYAXON_IS_MANAGED):
  the run is the job's run, POLYAXON_RUN_INSTANCE and nothing else (the client would otherwise
  prefer the project and run of a CLI cache in ~/.polyaxon; if it still resolves another run
  the trainer stops with exit 2). `ops resume` and retries reuse it (and its run directory in
  the store, or the outputs `autoResume` restores); `ops restart --copy` is a new run, seeded
  from the original's newest committed generation (copy_seed.py).
- *Offline* (POLYAXON_IS_OFFLINE=true, anywhere): the run lives under POLYAXON_OFFLINE_ROOT
  (default /tmp/plx/offline) in `runs/<uuid>/`. Setting POLYAXON_RUN_INSTANCE to
  `owner.project.runs.<uuid>` reopens that run, the local analogue of `ops resume`; without it
  every process is a new run.
Anything else is refused (exit 2) rather than tracked halfway.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import TrackingUnavailable, TrainerError, UsageError
from trainer.origin import install_extra
from trainer.integrations.polyaxon.internals import PROCESS_SIDECAR_ENV, answered_before_the_next, flush_only_at_exit

RUN_INSTANCE_ENV = "POLYAXON_RUN_INSTANCE"
OFFLINE_ENV = "POLYAXON_IS_OFFLINE"
METRICS = ("loss", "lr")
"""What the loop logs per step (tracking.py); their history says which steps are logged already."""
DONE_STATUSES = frozenset({"succeeded", "failed", "stopped", "skipped", "upstream_failed"})


@dataclass(frozen=True)
class TrackedRun:
    """An open `polyaxon.tracking.Run` and what opening it found out."""

    run: object
    mode: str
    """`managed` or `offline`."""
    logged_through: int | None
    """The highest step the run's metric history holds already (a resumed run logs after it)."""
    posts_status: bool
    """Whether the trainer records the final status (tracking.py's docstring): offline, and
    managed with a process sidecar."""


def open_tracked_run() -> TrackedRun:
    """Open the run, or raise TrackingUnavailable with one line saying why and how to fix it."""
    try:
        from polyaxon import settings
        from polyaxon.tracking import Run
    except ImportError as error:
        raise TrackingUnavailable(f"--tracked needs the polyaxon package ({error}); "
                                  f"{install_extra('polyaxon')}") from None
    for name in ("polyaxon", "traceml"):  # their INFO lines would interleave with progress lines
        logging.getLogger(name).setLevel(logging.WARNING)
    config = settings.CLIENT_CONFIG
    if config.no_op:
        raise TrackingUnavailable("--tracked, but Polyaxon tracking is switched off (POLYAXON_NO_OP); "
                                  "unset it, or run without --tracked and with --output DIR")
    instance = os.environ.get(RUN_INSTANCE_ENV)
    if config.is_managed:
        if not instance:
            raise UsageError(f"a managed Polyaxon run needs {RUN_INSTANCE_ENV} (owner.project.runs.UUID), "
                             f"which the agent sets in every container; run the job through Polyaxon")
        owner, project, run_uuid = parse_run_instance(instance)
        mode, identity = "managed", {"owner": owner, "project": project, "run_uuid": run_uuid}
    elif config.is_offline:
        mode = "offline"
        identity = {}
        if instance:
            owner, project, run_uuid = parse_run_instance(instance)
            identity = {"owner": owner, "project": project, "run_uuid": run_uuid}
    else:
        raise TrackingUnavailable(f"--tracked outside a Polyaxon job needs offline mode: set "
                                  f"{OFFLINE_ENV}=true (or run without --tracked and with --output DIR)")
    process_sidecar = mode == "managed" and os.environ.get(PROCESS_SIDECAR_ENV, "").lower() == "true"
    try:
        run = Run(**identity, track_code=False, track_logs=False)
        if mode == "managed":
            require_identity(instance, run)
            answered_before_the_next(run)
        if process_sidecar:
            flush_only_at_exit(run)
        outputs = run.get_outputs_path()
        if not outputs or not run.run_uuid:
            raise RuntimeError("no outputs path was assigned")
        if mode == "offline" and run.status in DONE_STATUSES:
            # An offline run reopened after it ended (stopped at exit 75): Polyaxon would
            # otherwise ignore this attempt's final status. Managed runs are moved by the agent.
            run.log_status("resuming", reason="TrainerResume", message="a new attempt continues this run")
            run.start()
        logged_through = max((s for s in (last_logged_step(run.get_artifacts_path(), m) for m in METRICS)
                              if s is not None), default=None)
    except TrainerError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of a third-party client means "cannot track"
        raise TrackingUnavailable(f"Polyaxon tracking could not start ({mode}): "
                                  f"{error.__class__.__name__}: {error}") from None
    return TrackedRun(run, mode, logged_through, posts_status=mode == "offline" or process_sidecar)


def parse_run_instance(value: str) -> tuple[str, str, str]:
    """`owner.project.runs.uuid` (Polyaxon's own format) → (owner, project, uuid)."""
    parts = value.split(".")
    if len(parts) != 4 or parts[2] != "runs" or not all(parts):
        raise TrackingUnavailable(f"{RUN_INSTANCE_ENV}={value!r} is not owner.project.runs.UUID; "
                                  f"fix it, or unset it to start a new offline run")
    return parts[0], parts[1], parts[3]


def require_identity(instance: str, run) -> None:
    """A managed run is POLYAXON_RUN_INSTANCE: a client that resolved another run (a CLI cache in
    ~/.polyaxon naming one) would track one run while writing another's run directory."""
    owner, project, run_uuid = parse_run_instance(instance)
    resolved = (run.owner, run.project, run.run_uuid)
    if resolved != (owner, project, run_uuid):
        raise UsageError(f"the Polyaxon client resolved run {'.'.join(map(str, resolved))}, but this job is "
                         f"{RUN_INSTANCE_ENV}={instance}; remove the CLI cache (~/.polyaxon) from the job's HOME")


def last_logged_step(artifacts_path: str, metric: str) -> int | None:
    """The highest step of `metric` already in the run's event history (restored with the run
    on resume, or left by an earlier offline process), read with Polyaxon's own reader."""
    from traceml.events import V1Events, get_event_path

    path = Path(get_event_path(artifacts_path, kind="metric", name=metric))
    if not path.is_file():
        return None

    frame = V1Events.read(kind="metric", name=metric, data=str(path)).df
    return None if frame.empty else int(frame["step"].max())
