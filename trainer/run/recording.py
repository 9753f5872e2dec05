"""The attempt record's start, from what the attempt established before training, and the
one record of an attempt that refused to train."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainer.config import RunConfig
from trainer.errors import TrainerError
from trainer.parallel.ranks import Ranks
from trainer.checkpoint.checkpointer import effective_mode
from trainer.run.attempts import (AttemptRecorder, AttemptStart, RefusedStart, previous_attempt, refuse_crash_loop,
                                  steps_replayed, world_size_change)
from trainer.run.records import AttemptRecord
from trainer.data.order import EpochShape, epoch_shape, require_even_split, training_steps
from trainer.run.fingerprint import check_fingerprint, current_fingerprint
from trainer.run.claim import Claim, Claimant
from trainer.run.events import TrainingEvents
from trainer.run.witness import ReplayWitness, computed_before, replay_not_compared
from trainer.parallel.reduction import Exactness, exactness
from trainer.run.failures import NONDETERMINISTIC_ALLOWED
from trainer.workload import BoundWorkload

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Checked:
    """What an attempt established before its record starts."""

    fingerprint: dict
    drift: tuple[str, ...]
    history: tuple[AttemptRecord, ...]
    """Every earlier attempt's record, oldest first (`Claim.history`)."""
    mode: str
    """The checkpoint mode this attempt writes with ("sync" or "async")."""
    exactness: Exactness
    shape: EpochShape
    """An epoch's batches (`--last-batch`): the sample ledger counts its trained and dropped samples."""


def check_attempt(config: RunConfig, workload: BoundWorkload, claim: Claim, dataset, ranks: Ranks) -> Checked:
    """Before the record starts: the batch split, the fingerprint, the crash-loop guard, the
    save mode. Rank 0 decides each; every rank learns the outcome (or the refusal)."""
    generation = claim.generation
    ranks.decide_on_primary(lambda: require_even_split(len(dataset), config.workload, ranks.world_size,
                                                       workload.has_train_step),
                            "checking the batch split")
    planned = workload.plan(training_steps(len(dataset), config.workload))
    fingerprint = current_fingerprint({**config.workload.training_relevant(), **planned}, dataset.fingerprint(),
                                      ranks.device, world_size=ranks.world_size,
                                      workload_sources=workload.source_files, backend=ranks.backend)
    drift = [] if generation is None else ranks.decide_on_primary(lambda: check_fingerprint(
        generation.name, generation.manifest.fingerprint, fingerprint, config.allow_drift),
        "checking the fingerprint")
    history = claim.history
    restoring = generation.name if generation else None
    ranks.decide_on_primary(lambda: refuse_crash_loop(history, restoring, config.max_failed_attempts,
                                                      claim.run.attempts), "checking for a crash loop")
    exact = exactness(config.workload.gradient_reduction, config.workload.data_parallel, ranks.world_size,
                      ranks.device.type)
    if config.allow_nondeterministic_ops:
        exact = Exactness(False, NONDETERMINISTIC_ALLOWED)
    if exact.reason and ranks.is_primary:
        log.warning("%s: %s", "exact" if exact.exact else "not exact", exact.reason)
    return Checked(fingerprint, tuple(drift), history, effective_mode(config.checkpoint_mode, ranks.device), exact,
                   epoch_shape(len(dataset), config.workload))


def start_record(config: RunConfig, claim: Claim, checked: Checked, ranks: Ranks,
                 events: TrainingEvents) -> AttemptRecorder:
    generation = claim.generation
    previous = previous_attempt(checked.history)
    step = generation.manifest.step if generation else None
    stored_world_size = generation.manifest.fingerprint.get("world_size") if generation else None
    start = AttemptStart(
        restored=None if generation is None else {"name": generation.name, "step": step,
                                                  "manifest_sha256": claim.manifest_sha256, "tier": claim.tier,
                                                  "shards_verified": "while loading" if generation.shards_pending
                                                  else "before loading", "bytes": claim.restored_bytes,
                                                  **({"refused": list(claim.refused)} if claim.refused else {})},
        explicit_generation=config.from_generation is not None,
        previous_attempt=previous.id if previous else None,
        steps_replayed=steps_replayed(previous, step) if generation else None,
        allowed_drift=config.allow_drift, drift=checked.drift, checkpoint_mode=checked.mode,
        device=str(ranks.device), fingerprint=checked.fingerprint, store=config.location.store_url,
        polyaxon=events.run_identity(previous), world_size=ranks.world_size,
        world_size_change=world_size_change(stored_world_size, ranks.world_size).get("world_size_change"),
        allow_unsigned=config.signing.allow_unsigned, exactness=checked.exactness.as_record(), joined=ranks.joined)
    replay = ReplayWitness(computed_before(checked.history, claim.run.attempt_folder, checked.fingerprint, step),
                           replay_not_compared(checked.drift), step) if generation and ranks.is_primary else None
    return AttemptRecorder.start(claim.run, claim.attempt_id, list(config.argv), start, persist=ranks.is_primary,
                                 replay=replay)


def record_refusal(claimant: Claimant, attempt_id: str, refusal: TrainerError, events: TrainingEvents,
                   started: float) -> None:
    """Rank 0, holding the run directory, refused to train (65, 70) before its record started:
    leave one `refused` record, so every start an orchestrator made is accounted for."""
    previous = previous_attempt(claimant.history)
    start = RefusedStart(claimant.considered, previous.id if previous else None, events.run_identity(previous))
    try:
        AttemptRecorder.refused_before_start(claimant.held, attempt_id, list(claimant.config.argv), refusal, start,
                                             started)
    except OSError as error:  # the refusal itself is what the user must see
        log.warning("could not record the refused attempt: %s", error)
