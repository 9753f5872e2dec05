"""The training run, top to bottom: claim the output → choose what to restore → build state
→ maybe restore → train → publish generations and exports on their cadence → record the attempt.

Under torchrun every rank runs this same flow. Rank 0 alone claims the output, chooses and
verifies the generation, checks the fingerprint, publishes, exports and records the attempt;
`self.ranks` hands its results (or its error) to the other ranks (see trainer/distributed.py).

Every blocking point of checkpointing is visible here: `save()` after a step the cadence
picked, `wait_for_staging()` right before the next optimizer step, `finalize()` before exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader

from trainer.attempts import (ATTEMPTS_DIR, REFUSED, AttemptRecorder, attempts_that_trained, is_crash_loop,
                              new_attempt_id, newest_generation, read_attempts, steps_replayed, utc_now)
from trainer.cadence import StepPoint, build_policy
from trainer.config import RunConfig
from trainer.distributed import Ranks, process_group, rank_seed, unshared_output, world_size_change
from trainer.errors import (EXIT_INTERRUPTED, EXIT_OK, CorruptGeneration, CrashLoop, FingerprintMismatch,
                            NothingToResume, RefuseOverwrite, TrainerError, UsageError)
from trainer.events import TrainingEvents
from trainer.export import EXPORTS_DIR, export_store, full_weights, write_export
from trainer.fingerprint import check_fingerprint, current_fingerprint
from trainer.launch import LaunchEnvironment
from trainer.lock import LOCK_NAME, OutputLock
from trainer.preemption import PreemptionGuard, ignore_late_stop_requests
from trainer.progress import Progress
from trainer.recovery.atomic import manifest_digest, storage_failure
from trainer.recovery.checkpointer import Published, build_checkpointer, effective_mode
from trainer.recovery.manifest import Verification
from trainer.recovery.resume import choose_candidate, require_verified
from trainer.recovery.snapshot import load_snapshot, stored_entries
from trainer.recovery.store import GenerationStore
from trainer.retention import apply_retention
from trainer.state import TrainingState
from trainer.workload import EpochBatchOrder, Workload, build_workload
from trainer.workload.data import uneven_split

log = logging.getLogger("trainer")
CHECKPOINTS_DIR = "checkpoints"


@dataclass(frozen=True)
class Hooks:
    """Test-only seams, set from environment variables by the CLI and nowhere else."""

    fault: Callable[[str], None] = lambda point: None
    skip_rng_restore: frozenset[str] = frozenset()


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    return torch.device(requested)


def configure_determinism(config: RunConfig, rank: int = 0) -> None:
    """Same algorithms, same thread count, same seeds: the precondition for bit-equality."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(config.workload.threads)
    seed = rank_seed(config.workload.seed, rank)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_output(config: RunConfig) -> Path:
    output = config.output
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output {output} is a file, not a directory; choose a directory path")
    if not output.exists() and (config.resume == "latest" or config.from_generation):
        raise NothingToResume(f"nothing to resume: {output} does not exist; "
                              f"check --output, or start without --resume")
    try:
        output.mkdir(parents=True, exist_ok=True)
        os.listdir(output)
    except (NotADirectoryError, FileExistsError):
        raise UsageError(f"--output {output}: part of the path is a file, not a directory; "
                         f"choose a directory path") from None
    except OSError as error:
        raise storage_failure(error, f"preparing --output {output}") from None
    if problem := misplaced_entry(output):
        raise RefuseOverwrite(f"{problem}; this is not a run directory of ours, so nothing was changed: "
                              f"move it away or choose another --output")
    return output


def misplaced_entry(output: Path) -> str | None:
    """An existing entry of the run layout that has the wrong kind (a file where a folder
    belongs, or the reverse), found before any work instead of at the first save."""
    for name in (CHECKPOINTS_DIR, EXPORTS_DIR, ATTEMPTS_DIR):
        if (output / name).exists() and not (output / name).is_dir():
            return f"{output / name} is a file, not a directory"
    if (output / LOCK_NAME).is_dir():
        return f"{output / LOCK_NAME} is a directory, not the lock file"
    return None


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM/SIGINT to the main process (which saves and exits
    75, then stops them); a process-group SIGTERM must not kill them mid-batch first."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def refuse_shape_changes(generation: str, template: dict, stored: dict) -> None:
    """An allowed config drift that changes tensor shapes cannot be restored: say so in one
    line instead of letting DCP fail with a size-mismatch traceback."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(template)
    for key, value in flat.items():
        entry = stored.get(key)
        if isinstance(value, torch.Tensor) and entry is not None and hasattr(entry, "size") \
                and tuple(entry.size) != tuple(value.shape):
            raise FingerprintMismatch(f"{generation} cannot be restored into this model: {key} is "
                                      f"{tuple(entry.size)} there, {tuple(value.shape)} here; a shape-changing "
                                      f"drift cannot be allowed, start a new --output instead")


def refuse_crash_loop(history: list[dict], restoring: str | None, limit: int, output: Path) -> None:
    if is_crash_loop(history, restoring, limit):
        raise CrashLoop(f"the last {limit} attempts all started from {restoring or 'scratch'} and died "
                        f"before publishing a newer generation; inspect {output / 'attempts'}, fix the "
                        f"cause, then rerun (or pass --max-failed-attempts 0)")


class TrainingRun:
    def __init__(self, config: RunConfig, hooks: Hooks, ranks: Ranks, events: TrainingEvents):
        self.config = config
        self.hooks = hooks
        self.ranks = ranks
        self.events = events
        self.workload: Workload = build_workload(config.workload)
        self.attempt_id = new_attempt_id()
        self.started = time.monotonic()
        self.claimed: Path | None = None
        """The output once rank 0 holds its lock."""
        self.considered: str | None = None
        """The generation chosen for restore, before it verified."""
        self.recorder: AttemptRecorder | None = None
        """This attempt's record once started (it then records its own end)."""
        self.verify_s = 0.0
        """Seconds spent verifying the generation to restore (part of the restore cost)."""
        self.preemption: PreemptionGuard | None = None
        self.progress = Progress.for_stdout(config.progress, config.workload.total_steps, ranks.is_primary)
        """Progress lines, or a status line on a terminal: rank 0 only."""

    # ----------------------------------------------------------------- top level
    def run(self) -> int:
        # Signals are caught for the whole attempt (claim, restore, training, final drain), so
        # a preemption at any moment ends as exit 75 with a `preempted` record.
        with contextlib.ExitStack() as held, PreemptionGuard(self.config.preempt_grace_secs) as preemption:
            self.preemption = preemption
            held.callback(self.progress.close)  # clears a terminal's status line on every way out
            # Rank 0's output wins: under --tracked only rank 0 opens the Polyaxon run and
            # knows its outputs path (other ranks start with output None).
            try:
                restored, self.attempt_id, output = self.ranks.decide_on_primary(
                    lambda: self.claim_output(held), "claiming the output")
                self.ranks.require_on_every_rank(unshared_output(output, self.ranks.is_primary),
                                                 "checking that every rank sees the output")
                return self.train_from(output, GenerationStore(output / CHECKPOINTS_DIR), restored)
            except (CorruptGeneration, FingerprintMismatch, CrashLoop) as refusal:
                self.record_refusal(refusal)
                raise

    def record_refusal(self, refusal: TrainerError) -> None:
        """Rank 0, holding the output, refused to train (65, 70) before its record started:
        leave one `refused` record, so every start an orchestrator made is accounted for."""
        if not self.ranks.is_primary or self.claimed is None or self.recorder is not None:
            return
        trained = attempts_that_trained(read_attempts(self.claimed))
        previous = trained[-1] if trained else None
        fields = {"restored": None, "considered_generation": self.considered,
                  "previous_attempt": previous["id"] if previous else None,
                  "polyaxon": self.events.run_identity(previous)}
        try:
            AttemptRecorder.record_refusal(self.claimed, self.attempt_id, list(self.config.argv), refusal.exit_code,
                                           str(refusal), fields, self.started)
        except OSError as error:  # the refusal itself is what the user must see
            log.warning("could not record the refused attempt: %s", error)

    def claim_output(self, held: contextlib.ExitStack) -> tuple[Verification | None, str, Path]:
        """Rank 0 only: take the output lock, clean up, choose and verify what to restore."""
        if problem := uneven_split(self.config.workload.samples, self.config.workload.batch_size,
                                   self.ranks.world_size):
            raise UsageError(problem)
        output = prepare_output(self.config)
        held.enter_context(OutputLock(output))
        self.claimed = output
        stores = (GenerationStore(output / CHECKPOINTS_DIR), export_store(output))
        for store in stores:
            for name in store.recover_interrupted_replacements():
                log.warning("restored %s/%s: a crash interrupted its replacement", store.root.name, name)
        started = time.monotonic()
        restored = self.choose_generation(stores[0])
        self.verify_s = time.monotonic() - started
        for store in stores:
            for name in store.remove_stale_temporaries():  # only once this attempt goes ahead
                log.info("removed stale temporary %s/%s", store.root.name, name)
        return restored, self.attempt_id, output

    def abandon_later_line(self, output: Path, restored_step: int) -> list[str]:
        """Rank 0, once the restore succeeded: an operator who goes back with
        --from-generation abandons every later generation and export. They are set aside
        as superseded copies (kept, never selected), so a later plain --resume cannot pick
        the abandoned line up again, and the new line never has to replace them.

        Exports go first, then generations oldest first: a crash part way leaves the
        abandoned line's newest generation in place, so a plain --resume continues that
        line as if the operator had not gone back, and nothing newer than the restored
        step is left in exports to outrank the new line's exports under retention."""
        if self.config.from_generation is None:
            return []
        abandoned = []
        for store in (export_store(output), GenerationStore(output / CHECKPOINTS_DIR)):
            abandoned += [f"{store.root.name}/{name}" for name in store.set_aside_later_than(restored_step)]
        if abandoned:
            log.warning("went back to %s: set aside %d later generations and exports (%s), kept as "
                        "superseded copies", self.config.from_generation, len(abandoned), ", ".join(abandoned))
        return abandoned

    def choose_generation(self, store: GenerationStore) -> Verification | None:
        names = store.names()
        candidate = choose_candidate(names, self.config.resume, self.config.from_generation, str(store.root))
        if candidate is None:
            return None
        self.considered = candidate
        verification = store.verify(candidate)
        require_verified(verification, [n for n in names if n < candidate], store.verify)
        return verification

    def train_from(self, output: Path, store: GenerationStore, restored: Verification | None) -> int:
        config, ranks = self.config, self.ranks
        device = ranks.device
        configure_determinism(config, ranks.rank)
        dataset = self.workload.build_dataset()
        fingerprint = current_fingerprint(config.workload.training_relevant(), dataset.fingerprint(),
                                          device, world_size=ranks.world_size)
        drift = []
        if restored is not None:
            drift = ranks.decide_on_primary(lambda: check_fingerprint(
                restored.path.name, restored.manifest["fingerprint"], fingerprint, config.allow_drift),
                "checking the fingerprint")
        history = read_attempts(output)
        restoring = restored.path.name if restored else None
        ranks.decide_on_primary(lambda: refuse_crash_loop(history, restoring, config.max_failed_attempts, output),
                                "checking for a crash loop")
        trained = attempts_that_trained(history)
        previous = trained[-1] if trained else None
        restored_step = restored.manifest["step"] if restored else None
        mode = effective_mode(config.checkpoint_mode, device, ranks.world_size)
        recorder = AttemptRecorder.start(output, self.attempt_id, list(config.argv), {
            "restored": None if restored is None else {
                "name": restored.path.name, "step": restored_step,
                "manifest_sha256": manifest_digest(restored.path)},
            "explicit_generation": config.from_generation is not None, "set_aside": [],
            "previous_attempt": previous["id"] if previous else None,
            "steps_replayed": steps_replayed(previous, restored_step) if restored else None,
            "allowed_drift": list(config.allow_drift), "drift": drift,
            "checkpoint_mode": mode, "device": str(device), "fingerprint": fingerprint,
            "polyaxon": self.events.run_identity(previous),
            "world_size": ranks.world_size, **world_size_change(restored, ranks.world_size),
        }, persist=ranks.is_primary)
        self.recorder = recorder
        checkpointer = build_checkpointer(mode, store, self.attempt_id, self.hooks.fault, device, ranks)
        self.preemption.last_words = lambda reason: recorder.finish("preempted", EXIT_INTERRUPTED, reason)
        try:
            self.events.attempt_started(recorder.record)
            return self._train(output, store, restored, recorder, device, dataset, fingerprint, drift, checkpointer)
        except (CorruptGeneration, FingerprintMismatch) as refusal:
            # Found while restoring, before the first step (a shape-changing drift, stored
            # data that disagrees with its rank): a refusal, like the ones found earlier.
            recorder.record.update(restored=None, steps_replayed=None, considered_generation=restoring)
            recorder.finish(REFUSED, refusal.exit_code, str(refusal))
            raise
        except TrainerError as error:
            self._record_drained(recorder, checkpointer.close_after_failure())
            recorder.finish("failed", error.exit_code, str(error))
            raise
        except BaseException as error:
            self._record_drained(recorder, checkpointer.close_after_failure())
            recorder.finish("failed", 1, f"{error.__class__.__name__}: {error}")
            raise

    # ----------------------------------------------------------------- training
    def _train(self, output, store, restored, recorder, device, dataset, fingerprint, drift, checkpointer) -> int:
        config, workload, ranks = self.config, self.workload, self.ranks
        model = workload.build_model().to(device)
        # Forward/backward through `trained`; state from `model` (the same module under FSDP,
        # sharded in place, so the optimizer below must be built after this).
        trained = ranks.data_parallel(model, config.workload.data_parallel)
        sharded = ranks.distributed and config.workload.data_parallel == "fsdp"
        optimizer = workload.build_optimizer(model)
        scheduler = workload.build_scheduler(optimizer)
        scaler = torch.amp.GradScaler(device.type, enabled=config.workload.amp and device.type == "cuda")
        state = TrainingState(model, optimizer, scheduler, scaler, rank=ranks.rank, world_size=ranks.world_size)
        recover_policy = build_policy(config.recover)
        export_policy = build_policy(config.export)

        if restored is not None:
            started = time.monotonic()
            stored = stored_entries(restored.path)
            template = state.template(stored)
            refuse_shape_changes(restored.path.name, template, stored)
            load_snapshot(template, restored.path)
            state.load_state_dict(template, self.hooks.skip_rng_restore)  # RNG last
            if any(change.startswith("config.") for change in drift):
                workload.adopt_config(optimizer, scheduler)  # an allowed --lr change takes effect
            cadence = restored.manifest.get("cadence", {})
            recover_policy.load_state(cadence.get("recover", {}))
            export_policy.load_state(cadence.get("export", {}))
            recorder.add_cost(restore_s=time.monotonic() - started + self.verify_s, verify_s=self.verify_s)
            abandoned = ranks.decide_on_primary(lambda: self.abandon_later_line(output, restored.manifest["step"]),
                                                "setting aside the abandoned line")
            if abandoned:
                recorder.update(set_aside=abandoned)
            log.info("restored %s (step=%d epoch=%d position=%d) in %.3fs", restored.path.name,
                     state.progress.global_step, state.progress.epoch, state.progress.position,
                     recorder.record["costs"]["restore_s"])
        recorder.update(first_step=state.progress.global_step, last_step=state.progress.global_step)

        exports = export_store(output)
        protected = frozenset([restored.path.name]) if restored else frozenset()
        total_steps = config.workload.total_steps
        autocast_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        interrupt = config.interrupt_at_step
        if interrupt is not None and not state.progress.global_step < interrupt <= total_steps:
            log.warning("--interrupt-at-step %d is outside steps %d..%d of this attempt; it will not fire",
                        interrupt, state.progress.global_step + 1, total_steps)

        def record_generations(published_now: list[Published]) -> None:
            # Async saves are published later than they are taken: record and prune only
            # what the checkpointer reports as published.
            for published in published_now:
                self._record_publish(recorder, "generations_published", published, state.progress.global_step)
                self.events.published("generation", store.path(published.name), published)
                if not ranks.is_primary:  # retention is the lock holder's job
                    continue
                for name in apply_retention(store, config.retention.keep_last, config.retention.keep_every,
                                            protected):
                    log.info("retention removed generation %s", name)

        def save_generation() -> None:
            progress = state.progress
            manifest = {"step": progress.global_step, "epoch": progress.epoch, "position": progress.position,
                        "fingerprint": fingerprint, "allowed_drift": drift, "created_utc": utc_now(),
                        "cadence": {"recover": {}, "export": export_policy.state()}}
            record_generations(checkpointer.save(state.state_dict(), progress.global_step, manifest))
            recover_policy.saved()

        def save_export() -> None:
            weights = full_weights(model, sharded)  # under FSDP a collective: every rank gathers
            if not ranks.is_primary:
                return
            progress = state.progress
            published = write_export(exports, weights, progress.global_step, progress.epoch,
                                     workload.architecture(), config.export_dtype, fingerprint["source"],
                                     self.attempt_id, self.hooks.fault)
            export_policy.saved()
            self._record_publish(recorder, "exports_published", published, progress.global_step)
            self.events.published("export", exports.path(published.name), published)
            for name in apply_retention(exports, config.retention.keep_exports, None, frozenset()):
                log.info("retention removed export %s", name)

        preemption = self.preemption
        if preemption.requested and not ranks.distributed:  # signalled while claiming or restoring
            recorder.finish("preempted", EXIT_INTERRUPTED,
                            f"{preemption.signal_name} before training resumed; nothing to save")
            log.info("preempted by %s before the first step (exit 75)", preemption.signal_name)
            return EXIT_INTERRUPTED
        while state.progress.global_step < total_steps:
            progress = state.progress
            order = EpochBatchOrder(config.workload.samples, config.workload.batch_size,
                                    config.workload.seed, progress.epoch, progress.position,
                                    ranks.rank, ranks.world_size)
            # A private generator keeps the DataLoader from drawing on the global torch RNG
            # (it seeds workers from it on every new iterator, which a resume would repeat).
            loader = DataLoader(dataset, batch_sampler=order, num_workers=config.workload.num_workers,
                                generator=torch.Generator().manual_seed(0), worker_init_fn=ignore_stop_signals)
            for inputs, labels in loader:
                recorder.add_cost(blocked_s=checkpointer.wait_for_staging())
                inputs, labels = inputs.to(device), labels.to(device)
                model.train()
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=config.workload.amp):
                    loss = workload.loss(trained, (inputs, labels))
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                epoch_completed = state.progress.advance(config.workload.batches_per_epoch)
                step = state.progress.global_step
                point = StepPoint(step, state.progress.epoch, epoch_completed)
                agreed = ranks.agree_after_step(loss, lambda: recover_policy.due(point),
                                                lambda: export_policy.due(point), preemption.requested)
                state.history.loss.append(agreed.loss)
                state.history.lr.append(float(lr))
                recorder.mark_step(step)
                self.progress.step(step, state.progress.epoch, state.history.loss[-1], lr,
                                   newest_generation(recorder.record), last=step in (interrupt, total_steps)
                                   or agreed.preempt)
                self.events.step_completed(step, {"loss": state.history.loss[-1], "lr": state.history.lr[-1]})

                if step == interrupt:
                    record_generations(checkpointer.finalize())  # an earlier save may be in flight
                    recorder.update(last_step=step)
                    recorder.finish("interrupted", EXIT_INTERRUPTED,
                                    f"--interrupt-at-step {step}: stopped without saving")
                    log.info("interrupted after step %d without saving (exit 75)", step)
                    return EXIT_INTERRUPTED

                final = step == total_steps
                if agreed.recover or final or agreed.preempt:
                    save_generation()
                if (agreed.export or final) and (ranks.is_primary or sharded):
                    save_export()
                if agreed.preempt:
                    record_generations(checkpointer.finalize())
                    signal_name = preemption.signal_name or "a signal to another rank"
                    recorder.update(last_step=step)
                    recorder.finish("preempted", EXIT_INTERRUPTED,
                                    f"{signal_name} after step {step}; generation saved")
                    log.info("preempted by %s: saved step %d (exit 75)", signal_name, step)
                    return EXIT_INTERRUPTED
        record_generations(checkpointer.finalize())
        names = store.names()
        summary = {"final_step": state.progress.global_step, "epochs": state.progress.epoch,
                   "final_generation": names[-1] if names else None,
                   "final_loss": state.history.loss[-1] if state.history.loss else None,
                   "history": {"loss": state.history.loss, "lr": state.history.lr}}
        recorder.update(last_step=state.progress.global_step)
        recorder.finish("completed", EXIT_OK, summary=summary)
        log.info("completed %d steps; newest generation %s", state.progress.global_step,
                 summary["final_generation"])
        return EXIT_OK

    @classmethod
    def _record_drained(cls, recorder: AttemptRecorder, published_now: list[Published]) -> None:
        for published in published_now:
            cls._record_publish(recorder, "generations_published", published, recorder.record["last_step"] or 0)

    @staticmethod
    def _record_publish(recorder: AttemptRecorder, kind: str, published: Published, step: int) -> None:
        recorder.record[kind].append({"name": published.name, "step": published.step,
                                      "save_s": round(published.save_s, 6),
                                      "blocked_s": round(published.blocked_s, 6), "at_s": recorder.elapsed_s()})
        recorder.add_cost(save_s=published.save_s, blocked_s=published.blocked_s)
        recorder.record["costs"]["saves"] += 1
        recorder.update(last_step=step)
        log.info("published %s %s in %.3fs", "generation" if kind.startswith("gen") else "export",
                 published.name, published.save_s)


def run_training(config: RunConfig, hooks: Hooks = Hooks(), launch: LaunchEnvironment = LaunchEnvironment(),
                 events: TrainingEvents = TrainingEvents()) -> int:
    """Run on every rank; all ranks return the same status."""
    with process_group(launch, resolve_device(config.device)) as ranks:
        run = TrainingRun(config, hooks, ranks, events)
        status = run.run()
        ignore_late_stop_requests()
        ranks.finish()
        if status == EXIT_INTERRUPTED and ranks.is_primary:
            # Resumable, not an error; one line on stderr all the same, where operators look.
            reason = run.recorder.record["reason"] if run.recorder else "stopped"
            print(f"trainer: stopped, resumable (exit 75): {reason}; continue with --resume auto",
                  file=sys.stderr, flush=True)
        return status

