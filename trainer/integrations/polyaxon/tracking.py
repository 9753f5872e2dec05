"""Polyaxon tracking for `--tracked`: the run directory, metrics, lineage and final status.

Only imported with `--tracked`: `polyaxon.tracking` costs about a second and 150 MB, which
an untracked run never pays.

Where it runs (managed or offline) and how the run is opened: tracked_run.py. References in the
run's lineage: lineage.py.

What is recorded:
- The trainer's run directory is the run's outputs in the artifacts store when the container
  can reach the store (`plugins: {mountArtifactsStore: true}`; trainer/integrations/polyaxon/placement.py): a
  store URL for a bucket store, the mounted folder for a volume store. Otherwise it is
  `get_outputs_path()`, which the sidecar uploads and `autoResume` restores. The tracking
  run's own files (events, logs) always stay in `get_outputs_path()`.
- `loss` and `lr` at the *global* step. Steps the run's metric history already holds (work an
  earlier attempt did past the restored generation, replayed now with identical values) are
  not logged again, so a resumed run appends and every step appears once.
- Each published generation (`dir`) and export (`model`) as a lineage *reference* carrying our
  manifest digest; Polyaxon does not re-hash the files and keeps the path relative to the run
  (`outputs/checkpoints/step-…`). In a bucket store the reference (and `newest_generation` /
  `export_path`) is logged once the store holds the generation (its manifest committed), and
  names its store URL, never the local tier; on a mounted volume store once it is published
  there. Only without the store exposed is a reference no proof of upload: the sidecar uploads
  the outputs path later. When retention
  deletes a generation or export, its reference is deleted too (offline: from the run's
  lineage; managed: the API's delete_run_artifact_lineage), so the lineage lists live artifacts.
- Attempt facts as run outputs: attempt id, restored generation and step, steps replayed; and
  the outputs the polyaxonfiles declare for pipelines: newest_generation, export_path
  (relative to the run directory, which is the run's outputs path in the store), final_loss.
- At the end of every attempt, the run's recovery report: its totals as outputs (goodput in
  percent of steps and of time, steps computed, replayed and lost, time lost in attempts,
  checkpoint overhead) and the timeline of all attempts so far as an image
  (`recovery-timeline`, at step 0, the one the dashboard's image widget opens on, replaced by
  every attempt, and at the attempt's last step, kept; a copy's as
  `recovery-timeline-of-this-copy`, beside the original's copied one). Best effort: a failure
  is a warning and never changes the exit status.
- What the runs list shows: the run's name (`original`, `resumed`, `copy-of-<uuid>`, with its
  attempt count), `first_params` (the inputs of its first attempt, which `ops resume`
  replaces), a copy's seed (`copied_from`, `newest_generation` and its lineage reference), and
  a stopped run's message naming its newest generation and the `ops resume` command.
- The final status from the exit code, 0 succeeded, 75 stopped (resumable), anything else
  failed, wherever nothing else would record it truthfully:
  - *offline*: nothing else records the outcome (closing an offline run marks it succeeded);
  - *managed with a process sidecar* (POLYAXON_HAS_PROCESS_SIDECAR, set by Polyaxon's docker and
    process executors): traceml registers a forced exit handler that calls `log_succeeded()`
    whatever the exit code, and the server keeps the first final status it receives (haupt
    `db/managers/statuses.py`, `new_status`: "Do not override final status"), so the
    executor's later `failed` would be dropped. The trainer replaces that handler by the
    flush-only one (internals.py) and posts the status itself.
  - *managed on Kubernetes* (no process sidecar): nothing is posted. The agent derives the
    status from the pod's exit and the Job's retries; a `failed` posted from the pod would end
    the run while maxRetries retries the pod. The client's managed exit handler only flushes.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Callable, Mapping

from trainer.errors import EXIT_INTERRUPTED, EXIT_OK, NothingToResume, TrainerError
from trainer.integrations.polyaxon.lineage import reference, reference_seed, remove_reference
from trainer.integrations.polyaxon.retries import call, one_line
from trainer.integrations.polyaxon.tracked_run import open_tracked_run
from trainer.layout import GENERATIONS, SECTIONS
from trainer.location import OnDisk, InStore
from trainer.run.events import TrainingEvents
from trainer.run.records import AttemptRecord

log = logging.getLogger("trainer")

TIMELINE = "recovery-timeline"
WHOLE_RUN_STEP = 0
"""The step of the timeline picture the run's page opens on: the whole run so far."""
RESUME_PRESET = "presets/resume.yaml"
PLAIN_RESTART_HINT = ("on Polyaxon, a plain `ops restart` starts with empty outputs: continue the original run "
                      "with `ops resume -uid UUID -f presets/resume.yaml`, or continue it in a new run with "
                      "`ops restart -uid UUID --copy`")


def cloning_kind(original_kind: str | None, run_uuid: str, previous_polyaxon: Mapping) -> str | None:
    """How this run relates to earlier work: `copy` / `restart` / `cache` (Polyaxon says so in
    the run's `original`), `resume` (no original, and the newest attempt in these outputs was
    made by this same run: `ops resume` or a `maxRetries` retry), or None (a fresh run).
    `previous_polyaxon`: that attempt's `polyaxon` (empty: none, or untracked)."""
    if original_kind:
        return original_kind
    previous_run = previous_polyaxon.get("run_uuid")
    return "resume" if previous_run == run_uuid else None


class PolyaxonEvents(TrainingEvents):
    """The loop's observer, backed by one `polyaxon.tracking.Run` (held here, never global)."""

    def __init__(self, run, mode: str, logged_through: int | None):
        self.run = run
        self.mode = mode
        self.logged_through = logged_through
        self.outputs_path = Path(run.get_outputs_path())
        """The tracking run's own outputs path (events, logs; the sidecar uploads it)."""
        self.run_directory = self.outputs_path
        """Where the trainer's run directory is on this machine: the outputs path, the run's
        folder on a mounted volume store, or the local tier of a run in a bucket store."""
        self.store_url: str | None = None
        """The run directory's store URL when it lives in a bucket store (see `place`)."""
        self.awaiting_durable: dict[tuple[str, str], tuple[str, object]] = {}
        """(kind, name) → (path in the run directory, Published): published on the local tier of
        a bucket-store run, not yet committed in the store."""
        self.last_loss: float | None = None
        self.posts_status = mode == "offline"
        """Whether the trainer records the final status (module docstring): offline, and managed
        with a process sidecar."""
        self.copied_from = None
        """A copy's seed (copy_seed.CopiedFrom), for the attempt record."""
        self.newest_generation: str | None = None
        """The newest generation this run's outputs name (published, or a copy's seed)."""
        self.cloning: str | None = None
        """How this run relates to earlier work (`cloning_kind`), once the attempt started."""

    @property
    def run_uuid(self) -> str:
        return self.run.run_uuid

    def place(self, placement) -> None:
        """Where the run directory is (trainer/integrations/polyaxon/placement.py): lineage and outputs then name
        the store location, never the local tier."""
        match placement.location:
            case InStore(store, local_tier):
                self.store_url, self.run_directory = store.url, local_tier
                log.info("tracking: generations go straight to %s (artifacts store %s; local tier %s)",
                         store.url, placement.connection, local_tier)
            case OnDisk(root):
                self.run_directory = root
                log.info("tracking: run directory %s (the artifacts store %s, mounted)", root, placement.connection)

    def original(self):
        return getattr(getattr(self.run, "run_data", None), "original", None)

    def log_outputs(self, **outputs) -> None:
        """One PATCH of the run, answered before the next: the server reads the run, merges and
        saves every field, so two PATCHes in flight at once (the client's default, async) can
        drop one's outputs, or the name. Retried on the sandbox's spurious 405 (which the async
        default lost without a word); a failure is one warning line, never the attempt's end."""
        try:
            call(self.run.log_outputs, async_req=False, **outputs)
        except Exception as error:  # noqa: BLE001 - outputs are a view of the run, not its state
            log.warning("tracking: could not log the outputs %s of run %s: %s", ", ".join(sorted(outputs)),
                        self.run_uuid, one_line(error))

    def original_uuid(self) -> str | None:
        return getattr(self.original(), "uuid", None)

    def seed_if_copy(self, placement, store_config) -> None:
        """`ops restart --copy`: seed this run's directory from the original's newest committed
        generation (copy_seed.py), once; what was copied goes into the attempt record."""
        if self.cloned_as_copy():
            from trainer.integrations.polyaxon.copy_seed import seed_copy

            self.copied_from = seed_copy(placement, self.run_uuid, self.original_uuid(), store_config)
            if self.copied_from is not None:
                self.log_seed(placement)

    def log_seed(self, placement) -> None:
        """A copy's outputs name what it holds from the start: the seeded generation (a lineage
        reference with the original's manifest digest) and where it came from."""
        seed = self.copied_from
        relative = f"{SECTIONS[GENERATIONS]}/{seed.generation}"
        location = f"{self.store_url}/{relative}" if self.store_url else str(self.run_directory / relative)
        reference_seed(self.run, location, seed)
        self.newest_generation = seed.generation
        self.log_outputs(newest_generation=seed.generation, copied_from=f"run {seed.run} {seed.generation}")

    def cloned_as_copy(self) -> bool:
        """`ops restart --copy`: a new run whose outputs were copied into its context path."""
        original = self.original()
        kind = getattr(getattr(original, "kind", None), "value", getattr(original, "kind", None))
        return kind == "copy"

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls) -> "PolyaxonEvents":
        """Open the run (tracked_run.py), or raise TrackingUnavailable with one line saying why
        and how to fix it."""
        opened = open_tracked_run()
        events = cls(opened.run, opened.mode, opened.logged_through)
        events.posts_status = opened.posts_status
        log.info("tracking: polyaxon %s run %s, outputs %s", opened.mode, opened.run.run_uuid, events.outputs_path)
        return events

    def track(self, train: Callable[[Path], int]) -> int:
        """Run `train(outputs_path)` and record how it ended; re-raise what it raised.

        Every path goes through `close` exactly once, including errors before the loop starts
        (a plain restart asked to `--resume`, a foreign generation, a held directory)."""
        try:
            exit_code = train(self.outputs_path)
        except NothingToResume as error:
            error = NothingToResume(f"{error}; {PLAIN_RESTART_HINT}")
            self.close(error.exit_code, str(error))
            raise error from None
        except TrainerError as error:
            self.close(error.exit_code, str(error))
            raise
        except BaseException as error:
            self.close(1, f"{error.__class__.__name__}: {error}")
            raise
        self.close(exit_code, None)
        return exit_code

    def close(self, exit_code: int, message: str | None) -> None:
        """The final loss as an output, and the final status where the trainer records it
        (`posts_status`). 75 must be `stopped`: closing an offline run without a status, or
        a process-sidecar run with traceml's handler, marks it succeeded. On Kubernetes the
        agent sets the status from the exit code, so only a log line says how it ended."""
        self.log_recovery_report()
        try:
            if self.last_loss is not None:
                self.log_outputs(final_loss=self.last_loss)
            if not self.posts_status:
                log.info("tracking: exit %d; the Polyaxon agent sets run %s's status from it",
                         exit_code, self.run.run_uuid)
            elif exit_code == EXIT_OK:
                self.run.log_succeeded(message="training completed")
            elif exit_code == EXIT_INTERRUPTED:
                self.run.log_stopped(reason="Exit75", message=self.stopped_message(message))
            else:
                self.run.log_failed(reason=f"Exit{exit_code}", message=message)
        except Exception as error:  # noqa: BLE001 - the training outcome stands; say what was not recorded
            log.warning("tracking: could not record the final status of run %s: %s", self.run.run_uuid, error)

    def stopped_message(self, reason: str | None) -> str:
        """What a stopped run's status says: why, what it would restore, the command that continues it."""
        newest = f"newest generation {self.newest_generation}" if self.newest_generation else "no generation yet"
        return f"{reason or 'interrupted or preempted (exit 75)'}; resumable from {newest}; to continue, " \
               f"{self.continue_hint()}"

    def continue_hint(self) -> str:
        return f"run `polyaxon ops resume -uid {self.run_uuid} -f {RESUME_PRESET}`"

    def log_recovery_report(self) -> None:
        """The report's totals as outputs and its timeline as an image, so the run's page shows
        what every restart so far cost. Never raises: the training outcome stands."""
        try:
            from trainer.inspect.listing import run_report, write_timeline

            try:
                report = run_report(self.run_directory)
            except NothingToResume:  # refused before any record was written (66, 73): nothing to show
                return
            name = f"{TIMELINE}-of-this-copy" if self.cloned_as_copy() else TIMELINE
            with tempfile.TemporaryDirectory() as folder:
                image = Path(folder) / f"{name}.png"
                write_timeline(report, image, for_dashboard=True)
                # Polyaxon's image widget opens on the lowest step the events hold: step 0 is
                # always the whole run so far (each attempt overwrites its asset), and the
                # attempt's last step keeps its own picture (a copy's under its own name: the
                # original's, copied with its events, keeps its steps).
                for step in (WHOLE_RUN_STEP, report.rows[-1].last_step):
                    self.run.log_image(data=str(image), name=name, step=step)
            t = report.totals
            self.name_run(t.attempts)
            self.log_outputs(attempts=t.attempts, useful_steps=t.useful, computed_steps=t.computed,
                             replayed_steps=t.replayed, lost_steps=t.lost, goodput_steps_pct=percent(t.goodput),
                             goodput_time_pct=percent(t.time_goodput), wall_lost_s=t.wall_lost_s,
                             checkpoint_overhead_pct=percent(t.checkpoint_share))
        except Exception as error:  # noqa: BLE001 - a picture must never change how the attempt ended
            log.warning("tracking: could not log the recovery report of run %s: %s: %s", self.run.run_uuid,
                        error.__class__.__name__, error)

    # ------------------------------------------------------------------ TrainingEvents
    def run_identity(self, previous_attempt: AttemptRecord | None) -> dict:
        original = self.original()
        original_kind = getattr(getattr(original, "kind", None), "value", getattr(original, "kind", None))
        previous = previous_attempt.polyaxon if previous_attempt else {}
        cloning = cloning_kind(original_kind, self.run.run_uuid, previous)
        # `ops resume` replaces the run's inputs (and its outputs): the first attempt's params are
        # carried from record to record, so every attempt shows them again.
        first = previous.get("first_params") if cloning == "resume" else \
            first_params(getattr(getattr(self.run, "run_data", None), "inputs", None))
        return {"run_uuid": self.run.run_uuid, "mode": self.mode, "cloning": cloning,
                "original_uuid": getattr(original, "uuid", None),
                "copied_from": self.copied_from.to_json() if self.copied_from else None, "first_params": first}

    def attempt_started(self, record: dict) -> None:
        restored = record.get("restored") or {}
        self.newest_generation = self.newest_generation or restored.get("name")
        outputs = {"attempt": record["id"], "restored_generation": restored.get("name"),
                   "restored_step": restored.get("step"), "steps_replayed": record.get("steps_replayed")}
        identity = record.get("polyaxon") or {}
        self.cloning = identity.get("cloning")
        self.log_outputs(**outputs, first_params=identity.get("first_params"))
        self.name_run()

    def name_run(self, attempts: int | None = None) -> None:
        try:
            call(self.run.set_name, run_name(self.cloning, self.original_uuid(), attempts), async_req=False)
        except Exception as error:  # noqa: BLE001 - a name is a label: the attempt goes on without it
            log.warning("tracking: could not name run %s: %s", self.run_uuid, one_line(error))

    def step_completed(self, step: int, metrics: dict[str, float]) -> None:
        self.last_loss = metrics.get("loss", self.last_loss)
        if self.logged_through is not None and step <= self.logged_through:
            return  # replayed after an older generation: the history already has this step
        self.run.log_metrics(step=step, **metrics)

    def published(self, kind: str, path: Path, published) -> None:
        if self.store_url is None:  # the published directory is where the run keeps it
            self.log_reference(kind, str(path), path.relative_to(self.run_directory).as_posix(), published)
        else:  # published on the local tier: referenced once the store holds it (`durable`)
            self.awaiting_durable[(kind, published.name)] = (path.relative_to(self.run_directory).as_posix(),
                                                             published)

    def durable(self, kind: str, name: str) -> None:
        waiting = self.awaiting_durable.pop((kind, name), None)
        if waiting is not None:
            relative, published = waiting
            self.log_reference(kind, f"{self.store_url}/{relative}", relative, published)

    def log_reference(self, kind: str, location: str, relative: str, published) -> None:
        """The lineage reference (at `location`) and the pipeline output of a published
        generation or export; `relative` is its path in the run directory, which is also its
        path under the run's outputs in the artifacts store."""
        reference(self.run, kind, location, published)
        if kind == "export":
            self.log_outputs(export_path=relative)
        else:
            self.newest_generation = published.name
            self.log_outputs(newest_generation=published.name)

    def removed(self, kind: str, name: str) -> None:
        """Drop the lineage reference of a generation or export retention deleted (lineage.py)."""
        if self.awaiting_durable.pop((kind, name), None) is None:  # else removed before it reached the store
            remove_reference(self.run, self.mode, kind, name)


def percent(share: float | None) -> float | None:
    return None if share is None else round(100 * share, 1)


def first_params(inputs: dict | None) -> str:
    """The run's params as its first attempt saw them (`k=v, ...`, unset ones left out)."""
    return ", ".join(f"{key}={value}" for key, value in sorted((inputs or {}).items()) if value is not None)


def run_name(cloning: str | None, original_uuid: str | None, attempts: int | None = None) -> str:
    """The run's name in the runs list: what it is to its original (and, once an attempt ended,
    how many attempts its run directory holds). A slug, as the server requires (`[-a-zA-Z0-9_]+`):
    `original`, `resumed-2-attempts`, `copy-of-<uuid>-1-attempt`."""
    kind = {"copy": f"copy-of-{original_uuid}", "restart": f"restart-of-{original_uuid}",
            "resume": "resumed"}.get(cloning or "", "original")
    return f"{kind}-{attempts}-attempt{'' if attempts == 1 else 's'}" if attempts else kind
