"""One attempt's hold on its run directory, from the claim to the end, whoever owns the loop.

The trainer's loop (`run/loop.py`) and a user's own loop (`trainer/recovery/`) go through the
same four steps here: `claim` the run directory (lock or lease, the generation chosen and
verified), `begin` the attempt once the state's ingredients are known (fingerprint, crash
loop, the record, the cadenced saves), then `end` it (drain the saves, record the outcome)
or `fail` it (the failure recorded, as one line naming where). A refusal found before the
record started leaves one `refused` record (`refusals_recorded`). So both loops write the
same generations, records and lines, and neither implements a save or a restore of its own.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Iterator, NoReturn

from trainer.config import RunConfig
from trainer.errors import EXIT_INTERRUPTED, EXIT_OK, CorruptGeneration, CrashLoop, FingerprintMismatch, \
    PeerFailure, UntrustedGeneration
from trainer.parallel.ranks import Ranks, unshared_output
from trainer.run.attempts import AttemptRecorder, new_attempt_id
from trainer.run.claim import Claim, Claimant, claim_on_every_rank
from trainer.run.events import TrainingEvents
from trainer.run.failures import attributed
from trainer.run.preemption import PreemptionGuard
from trainer.run.recording import Checked, check_attempt, record_refusal, start_record
from trainer.run.records import COMPLETED, PREEMPTED
from trainer.run.saving import CadencedSaves, Lineage, SaveTargets, Witnesses
from trainer.run.state import TrainingState
from trainer.storage.opening import open_memory_tier, open_storage
from trainer.workload import BoundWorkload

log = logging.getLogger("trainer")
REFUSALS = (CorruptGeneration, FingerprintMismatch, CrashLoop, UntrustedGeneration)
"""Found before training: the attempt holds the run directory but refuses to go on (65, 70)."""
RESTORE_REFUSALS = (CorruptGeneration, FingerprintMismatch, UntrustedGeneration)
"""Found while restoring, before the first step (a shape-changing drift, stored data that
disagrees with its rank): refusals too, recorded in the started record."""


@dataclass(frozen=True)
class Outcome:
    status: int
    reason: str | None
    """Why the attempt ended (None for a completed run)."""


class AttemptSession:
    def __init__(self, config: RunConfig, ranks: Ranks, events: TrainingEvents):
        self.config, self.ranks, self.events = config, ranks, events
        self.attempt_id, self.started = new_attempt_id(), time.monotonic()
        self.storage = open_storage(config, ranks.launch)
        self.memory = open_memory_tier(config, ranks.launch, self.storage.signing)
        self.claimant = Claimant(config, self.storage, self.memory, one_pass=ranks.world_size == 1)
        self.recorder: AttemptRecorder | None = None
        """This attempt's record once started (it then records its own end)."""

    def claim(self, held: contextlib.ExitStack) -> Claim:
        """Every rank: rank 0 holds the run directory (until `held` closes) and chooses the
        generation; its run directory wins (under --tracked only rank 0 knows the outputs path)."""
        claim = claim_on_every_rank(self.claimant, self.ranks, self.attempt_id, held)
        if not self.ranks.is_primary:
            self.storage.join(claim.run)
        if self.storage.shares_one_disk:
            self.ranks.require_on_every_rank(unshared_output(claim.run.root, self.ranks.is_primary),
                                             "checking that every rank sees the run directory")
        self.attempt_id = claim.attempt_id
        return claim

    @contextlib.contextmanager
    def refusals_recorded(self) -> Iterator[None]:
        """Around the whole attempt: a refusal before the record started leaves a `refused`
        record; the record is pushed where it survives this machine on every way out."""
        try:
            yield
        except REFUSALS as refusal:
            if self.ranks.is_primary and self.claimant.held is not None and self.recorder is None:
                record_refusal(self.claimant, self.attempt_id, refusal, self.events, self.started)
            raise
        finally:
            if self.claimant.held is not None:
                self.storage.records.push(self.claimant.held.attempt_folder(self.attempt_id))

    def begin(self, claim: Claim, workload: BoundWorkload, dataset, preemption: PreemptionGuard,
              config: RunConfig | None = None) -> tuple[CadencedSaves, Checked]:
        """Check the environment (fingerprint, crash loop, mode), start the record, build the
        cadenced saves. `config`: the run's, once the data adopted a DataLoader's settings."""
        config, ranks = config or self.config, self.ranks
        generation = claim.generation
        checked = check_attempt(config, workload, claim, dataset, ranks)
        recorder = self.recorder = start_record(config, claim, checked, ranks, self.events)
        self.storage.records.push(claim.run.attempt_folder(self.attempt_id))  # a kill -9 of this machine still counts
        lineage = Lineage(self.attempt_id, checked.fingerprint, checked.drift,
                          frozenset([generation.name]) if generation else frozenset(), checked.shape, claim.history)
        if claim.download.bytes:
            recorder.downloaded(claim.download.seconds, claim.download.bytes)
        saves = CadencedSaves(config, SaveTargets(self.storage, self.memory), lineage, ranks,
                              Witnesses(recorder, self.events), checked.mode)
        preemption.last_words = lambda reason: recorder.ended(PREEMPTED, EXIT_INTERRUPTED, reason)
        return saves, checked

    def fail(self, error: BaseException, claim: Claim, saves: CadencedSaves, preemption: PreemptionGuard) -> NoReturn:
        """The attempt ends on `error`: a refusal found while restoring is recorded as one; any
        other failure finishes what is in flight and is recorded `failed`, one line naming where."""
        if isinstance(error, RESTORE_REFUSALS):
            generation = claim.generation
            self.recorder.refused(error.exit_code, str(error), generation.name if generation else None)
            raise error
        preemption.decided()  # a stop signal from here on cannot make this failure a 75
        error = self.ranks.as_peer_failure(error)  # a lost peer is never the workload's error
        saves.close_after_failure(peers_lost=isinstance(error, PeerFailure))
        attributed(error).record_and_raise(self.recorder)  # the workload's own exception: one line naming where

    def end(self, status: str, reason: str | None, saves: CadencedSaves, state: TrainingState,
            said: str | None = None) -> Outcome:
        """The one way out of training: drain the save in flight, record, say so."""
        step = state.progress.global_step
        self.ranks.finishing()  # draining was never measured: the peers wait as at the start
        saves.finalize(step)  # an earlier save may still be in flight, and uploads
        exit_code, summary = EXIT_INTERRUPTED, None
        if status == COMPLETED:
            # Saving straight to an object store leaves no local copies: this attempt's record knows.
            newest = max(saves.generations.names()[-1:] + [self.recorder.newest_generation or ""])
            exit_code = EXIT_OK
            summary = {"final_step": step, "epochs": state.progress.epoch,
                       "final_generation": newest or None,
                       "final_loss": state.history.loss[-1] if state.history.loss else None,
                       "history": {"loss": state.history.loss, "lr": state.history.lr}}
            said = f"completed {step} steps; newest generation {summary['final_generation']}"
        # What survives this machine: in the log, the record and the 75 line.
        if durable := self.storage.records.note(self.recorder.newest_durable, self.claimant.considered):
            said += f"; {durable}"
            reason = f"{reason}; {durable}" if reason else reason
        self.recorder.reached(step)
        self.recorder.ended(status, exit_code, reason, summary)
        log.info("%s", said)
        return Outcome(exit_code, reason)
