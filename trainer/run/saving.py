"""Saving on cadence: after each optimizer step, which save paths fire, and what every
publish leaves behind (the attempt record, an observer event, retention).

The loop calls `after_step()` once per step with what the ranks agreed, `wait_for_staging()`
right before the next optimizer step, and `finalize()` before it ends, so every blocking
point of checkpointing stays visible in the loop. Async saves are published later than they
are taken: generations are recorded and pruned only once the checkpointer reports them
published.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from torch import nn

from trainer.run.attempts import EXPORTS, GENERATIONS, AttemptRecorder, auto_prior, read_attempts, utc_now
from trainer.run.cadence import CadenceChange, StepPoint, auto_trigger, build_policy
from trainer.config import RunConfig
from trainer.parallel.ranks import Ranks, StepAgreement
from trainer.run.events import TrainingEvents
from trainer.checkpoint.export import full_weights, write_export
from trainer.checkpoint.manifest import GenerationFacts
from trainer.checkpoint.section import LocalSection, Published
from trainer.checkpoint.retention import apply_retention
from trainer.layout import RunDirectory
from trainer.run.state import TrainingState
from trainer.storage.object.tiering import EXPORTS_SECTION, GENERATIONS_SECTION, Durable, Uploader, apply_store_retention
from trainer.workload import Workload

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Lineage:
    """What every generation this attempt publishes carries in its manifest."""

    fingerprint: dict
    allowed_drift: tuple[str, ...]
    protected: frozenset[str]
    """Generations retention must keep (the one restored)."""


class CadencedSaves:
    def __init__(self, config: RunConfig, run: RunDirectory, checkpointer, lineage: Lineage, ranks: Ranks,
                 recorder: AttemptRecorder, events: TrainingEvents, attempt_id: str, uploader: Uploader | None = None):
        self.config, self.ranks, self.recorder, self.events = config, ranks, recorder, events
        self.checkpointer = checkpointer
        self.generations = checkpointer.store
        self.exports = LocalSection(run.exports)
        self.lineage = lineage
        self.attempt_id = attempt_id
        self.recover_policy = build_policy(config.recover, prior=auto_prior(read_attempts(run.root), attempt_id)
                                           if config.recover.auto and ranks.is_primary else None)
        self.auto = auto_trigger(self.recover_policy)
        """`--recover-every-secs auto`: re-derived after every recovery save (rank 0 decides)."""
        if self.auto is not None:
            self.cadence_changed(self.auto.current, None)
        self.export_policy = build_policy(config.export)
        self.sharded = ranks.distributed and config.workload.data_parallel == "fsdp"
        self.uploader = uploader
        """With a store: makes what is published here durable there (rank 0)."""
        self.upload_inline = config.store_config.max_pending_uploads == 0

    def load_cadence(self, cadence: dict) -> None:
        """Continue the cadence counters a restored generation carried."""
        self.recover_policy.load_state(cadence.get("recover", {}))
        self.export_policy.load_state(cadence.get("export", {}))

    def agree(self, point: StepPoint, loss, preempted: bool) -> StepAgreement:
        """Every rank learns rank 0's cadence decisions and whether any rank was signalled."""
        return self.ranks.agree_after_step(loss, lambda: self.recover_policy.due(point),
                                           lambda: self.export_policy.due(point), preempted)

    def wait_for_staging(self) -> None:
        self.recorder.waited(self.checkpointer.wait_for_staging())

    def after_step(self, state: TrainingState, model: nn.Module, workload: Workload, agreed: StepAgreement,
                   final: bool) -> None:
        self.record_durable(self.uploader.completed() if self.uploader else [])
        if agreed.recover or final or agreed.preempt:
            self.save_generation(state)
        if (agreed.export or final) and (self.ranks.is_primary or self.sharded):
            self.save_export(state, model, workload)

    def save_generation(self, state: TrainingState) -> None:
        progress = state.progress
        facts = GenerationFacts(progress.global_step, progress.epoch, progress.position, self.lineage.fingerprint,
                                self.lineage.allowed_drift, {"recover": {}, "export": self.export_policy.state()},
                                utc_now())
        self.record_generations(self.checkpointer.save(state.state_dict(), facts), progress.global_step)
        self.recover_policy.saved()

    def save_export(self, state: TrainingState, model: nn.Module, workload: Workload) -> None:
        weights = full_weights(model, self.sharded)  # under FSDP a collective: every rank gathers
        if not self.ranks.is_primary:
            return
        progress = state.progress
        published = write_export(self.exports, weights, progress.global_step, progress.epoch,
                                 workload.architecture(), self.config.export_dtype,
                                 self.lineage.fingerprint["source"], self.attempt_id)
        self.export_policy.saved()
        self._published(EXPORTS, self.exports, published, progress.global_step)
        for name in apply_retention(self.exports, self.config.retention.keep_exports, None,
                                    self.kept_for_the_store(EXPORTS_SECTION)):
            log.info("retention removed export %s", name)
            self.events.removed("export", name)

    def finalize(self, step: int) -> None:
        """Drain the save in flight (it publishes), then the uploads (they make it durable),
        before the attempt ends."""
        self.record_generations(self.checkpointer.finalize(), step)
        if self.uploader is not None:
            self.record_durable(self.uploader.drain())
            self.uploader.close()

    def close_after_failure(self) -> None:
        """After a failure: finish what is in flight and record it; never raises."""
        self.record_generations(self.checkpointer.close_after_failure(), None, prune=False)
        if self.uploader is not None:
            try:  # what is published may still become durable
                self.record_durable(self.uploader.drain())
            except Exception as error:  # noqa: BLE001 - the original failure is what ends the attempt
                log.warning("an upload failed too: %s", error)
            self.uploader.close()

    def committed_directly(self, published: Published) -> None:
        """Several processes saving straight to the store: durable already; rank 0 prunes the
        store (the scratch copies are gone, nothing to prune locally)."""
        self.recorder.durable(GENERATIONS, published.name, published.save_s, published.save_s)
        self.events.durable("generation", published.name)
        if not self.ranks.is_primary:
            return
        if self.uploader is not None:
            self.uploader.push_record()
        retention = self.config.retention
        for name in apply_store_retention(self.checkpointer.section, retention.keep_last, retention.keep_every,
                                          self.lineage.protected | {published.name}, self.checkpointer.fence):
            self.events.removed("generation", name)

    def record_durable(self, durable: list[Durable]) -> None:
        for done in durable:
            kind = GENERATIONS if done.kind == GENERATIONS_SECTION else EXPORTS
            self.recorder.durable(kind, done.name, done.upload_s, done.durable_s)
            self.events.durable("generation" if kind == GENERATIONS else "export", done.name)
            log.info("durable %s %s in %.3fs (upload %.3fs, %d bytes)",
                     "generation" if kind == GENERATIONS else "export", done.name, done.durable_s, done.upload_s,
                     done.bytes)

    def kept_for_the_store(self, kind: str) -> frozenset[str]:
        """Local retention never deletes what is not durable yet, nor the newest durable one."""
        if self.uploader is None:
            return frozenset() if kind == EXPORTS_SECTION else self.lineage.protected
        newest = self.uploader.newest_durable(kind)
        kept = self.uploader.not_durable(kind) | ({newest} if newest else set())
        return frozenset(kept) | (self.lineage.protected if kind == GENERATIONS_SECTION else frozenset())

    def record_generations(self, published_now: list[Published], step: int | None, prune: bool = True) -> None:
        retention = self.config.retention
        for published in published_now:
            self._published(GENERATIONS, self.generations, published, step)
            if self.auto is not None and (change := self.auto.measured(published.blocked_s)):
                self.cadence_changed(change, published.step)
            if not prune or not self.ranks.is_primary:  # retention is the lock holder's job
                continue
            for name in apply_retention(self.generations, retention.keep_last, retention.keep_every,
                                        self.kept_for_the_store(GENERATIONS_SECTION)):
                log.info("retention removed generation %s", name)
                self.events.removed("generation", name)

    def cadence_changed(self, change: CadenceChange, step: int | None) -> None:
        if self.ranks.is_primary:
            log.info("%s", change.line())
        self.recorder.cadence_changed(change.as_record(step, self.recorder.elapsed_s()))

    def _published(self, kind: str, store: LocalSection, published: Published, step: int | None) -> None:
        self.recorder.published(kind, published, step)
        self.events.published("generation" if kind == GENERATIONS else "export", store.path(published.name),
                              published)
        if kind == GENERATIONS and getattr(self.checkpointer, "durable_on_save", False):
            self.committed_directly(published)
        elif self.uploader is not None:
            section = GENERATIONS_SECTION if kind == GENERATIONS else EXPORTS_SECTION
            waiting = time.monotonic()
            self.uploader.submit(section, published.name, store.path(published.name), waiting - published.save_s)
            if self.upload_inline:  # every save waits until it is durable
                self.record_durable(self.uploader.drain())
            self.recorder.waited(time.monotonic() - waiting)
        log.info("published %s %s in %.3fs", "generation" if kind == GENERATIONS else "export",
                 published.name, published.save_s)
