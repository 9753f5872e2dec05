"""Claiming the run directory (rank 0): hold it, choose the generation to restore, verify it.

The order is the contract: hold (a lock or a lease, so a second writer is refused with 73 before
anything is read), choose (66 or 73 before anything is deleted), know the run's identity (what
a generation must belong to: created with the run directory), let the backend go ahead
(an object store's uncommitted leftovers go), verify and fetch the choice (65 names the way
back), then remove stale temporaries.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace

from trainer.checkpoint.atomic import manifest_digest
from trainer.checkpoint.identity import RunIdentity, identity_or_problem
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.resume import choose_candidate
from trainer.config import RunConfig, WorkloadConfig
from trainer.layout import RunDirectory
from trainer.checkpoint.coordination import Coordinator, raise_if_any_failed
from trainer.errors import CorruptGeneration, DecidedOnPrimary, UsageError
from trainer.run.records import DISK, MEMORY, PEER, STORE, AttemptRecord, read_attempt_records, went_back
from trainer.storage.base import NOTHING_MOVED, RunStorage, Transfer
from trainer.storage.memory.choice import Holding, disagreement, newer_than
from trainer.storage.memory.tier import MemoryTier

log = logging.getLogger("trainer")


def run_identity(run: RunDirectory) -> RunIdentity | None:
    """The run directory's identity as it stands before this attempt goes ahead (None: none yet)."""
    identity, _ = identity_or_problem(run.identity.read_bytes() if run.identity.is_file() else None)
    return identity


@dataclass(frozen=True)
class Claim:
    """What rank 0 found once it held the run directory, handed to every rank."""

    run: RunDirectory
    attempt_id: str
    generation: Verification | None
    """The verified generation to restore (None: a fresh start)."""
    verify_s: float
    """Verifying before the state existed: every file, or (`generation.shards_pending`) all
    but the shards, whose digest the load checks as it reads them (trainer/run/restoring.py)."""
    manifest_sha256: str | None = None
    """Of the generation to restore: names exactly which sealed content is restored."""
    download: Transfer = NOTHING_MOVED
    """What restoring from an object store downloaded (nothing when the local tier had it)."""
    tier: str = DISK
    """Where the generation was restored from: MEMORY (tier 0), PEER (tier 0, some ranks' parts
    fetched from their partners), DISK or STORE."""
    refused: tuple[str, ...] = ()
    """Faster sources refused on the way ("TIER NAME: problem"): a damaged tier-0 generation."""
    identity: RunIdentity | None = None
    """The run's identity once this attempt went ahead: what tier 0 is bound to on every rank."""
    memory: str | None = None
    """A tier-0 generation rank 0 chose, until every rank made sure of its part (`settle`):
    then `generation` is this rank's part."""
    memory_attempt: str = ""
    """The attempt that wrote every rank's part of `memory` (its line)."""
    history: tuple[AttemptRecord, ...] = ()
    """Every earlier attempt's record, oldest first: read once, when rank 0 held the run
    directory, for the choice, the crash-loop guard, the record's start and the auto cadences."""

    def kept(self, settings: WorkloadConfig, ranks: Coordinator) -> WorkloadConfig:
        """`settings` as this attempt trains with them: a resume keeps its generation's gradient
        reduction (`WorkloadConfig.kept_reduction`), read from rank 0's manifest so that every
        rank installs the same one (a rank's tier-0 part is its own)."""
        if self.generation is None:
            return settings
        return ranks.decide_on_primary(
            lambda: settings.kept_reduction(self.generation.manifest.fingerprint.get("config")),
            "reading the generation's gradient reduction")

    @property
    def restored_bytes(self) -> int:
        """The bytes of the restored generation's files."""
        files = self.generation.manifest.files if self.generation is not None else {}
        return sum(int(entry.get("bytes", 0)) for entry in files.values())


class Claimant:
    """Rank 0's claim. What it found stays readable after a refusal, for the refused record."""

    def __init__(self, config: RunConfig, storage: RunStorage, memory: MemoryTier, one_pass: bool = False):
        self.config = config
        self.storage = storage
        self.memory = memory
        """Tier 0 (`storage/opening.py` `open_memory_tier`): every rank holds its own, rank 0 chooses."""
        self.one_pass = one_pass
        """The backend may leave a durable generation's shard hashes to the load (one rank)."""
        self.held: RunDirectory | None = None
        """This machine's run directory, once this attempt holds it."""
        self.considered: str | None = None
        """The generation chosen for restore, before it verified."""
        self.durable: list[str] = []
        self.history: tuple[AttemptRecord, ...] = ()
        """The run's attempt records, read once it is held (`Claim.history`)."""

    def claim(self, attempt_id: str, held: contextlib.ExitStack, holdings: list[Holding]) -> Claim:
        """`holdings`: what every rank's tier 0 holds (gathered before: each rank holds its own)."""
        config, storage = self.config, self.storage
        storage.claim(attempt_id, held, must_exist=config.resume == "latest" or config.from_generation is not None)
        self.held = storage.local
        started = time.monotonic()
        durable = self.durable = storage.committed()
        self.history = tuple(read_attempt_records(storage.local.root))
        newer = newer_than(holdings, durable, went_back(self.history),  # tier 0 first: the fastest
                           run_identity(storage.local))
        where = storage.generations_where + (f" and tier 0 ({self.memory.where})" if newer else "")
        self.considered = choose_candidate(durable + list(newer), config.resume, config.from_generation, where)
        identity = storage.go_ahead(attempt_id, config.adopt_from)  # what the generation must belong to, tier 0 too
        if self.considered in newer:  # every rank verifies its own part next (`settle`)
            storage.remove_stale_temporaries()
            return Claim(storage.local, attempt_id, None, time.monotonic() - started, tier=MEMORY, identity=identity,
                         memory=self.considered, memory_attempt=newer[self.considered], history=self.history)
        generation, download = None, NOTHING_MOVED
        if self.considered:
            generation, download = storage.restorable(self.considered, durable, self.one_pass)
        return self.claimed(attempt_id, identity, generation, download, started)

    def claimed(self, attempt_id: str, identity: RunIdentity | None, generation: Verification | None,
                download: Transfer, started: float, refused: tuple[str, ...] = ()) -> Claim:
        storage = self.storage
        if generation is not None and generation.manifest.run is None:
            log.warning("%s names no run (written before run ids): restored as this run's own", generation.name)
        verify_s = time.monotonic() - started - download.seconds
        storage.remove_stale_temporaries()
        return Claim(storage.local, attempt_id, generation, verify_s,
                     manifest_digest(generation.path) if generation else None, download,
                     STORE if download.bytes else DISK, refused, identity, history=self.history)

    def instead_of(self, claim: Claim, problems: dict[int, str]) -> Claim:
        """Rank 0, when some rank's part of the chosen tier-0 generation cannot serve (damaged,
        and no replica to fetch): the newest earlier durable generation, with one warning."""
        started, name = time.monotonic(), claim.memory
        earlier = [durable for durable in self.durable if durable < name]
        problem = "; ".join(f"rank {rank}: {why}" if len(problems) > 1 or rank else why
                            for rank, why in sorted(problems.items()))
        instead = f"restoring {earlier[-1]} from {self.storage.generations_where}" if earlier else \
            "no durable generation to restore instead"
        log.warning("tier 0 refused %s (%s): %s", name, problem, instead)
        if not earlier:
            raise CorruptGeneration(f"tier-0 generation {name} in {self.memory.where} does not verify "
                                    f"({problem}) and no durable generation is older; remove it to start over")
        self.considered = earlier[-1]
        generation, download = self.storage.restorable(earlier[-1], self.durable, self.one_pass)
        return self.claimed(claim.attempt_id, claim.identity, generation, download, started,
                            (f"{MEMORY} {name}: {problem}",))


def claim_on_every_rank(claimant: Claimant, ranks: Coordinator, attempt_id: str, held: contextlib.ExitStack) -> Claim:
    """Every rank checks that tier 0 was given alike everywhere, holds its own tier 0 and says
    what it holds; rank 0 claims the run directory and chooses; then, if it chose a tier-0
    generation, every rank makes sure of its own part (`settle`)."""
    memory = claimant.memory
    problem = disagreement(ranks.gather(memory.agreement(), "comparing tier 0's options")) \
        if ranks.distributed else None
    if problem:  # before anything is written: the tier-0 rounds would wait on each other
        raise UsageError(problem) if ranks.is_primary else DecidedOnPrimary(problem, UsageError.exit_code)
    failure = None
    try:
        memory.claim(held)
    except Exception as error:  # noqa: BLE001 - every rank must hear of it (a wrong --memory-dir on one node)
        failure = error
    raise_if_any_failed(ranks, failure, "holding tier 0")
    holdings = ranks.gather(memory.holding(), "listing tier 0")
    claim = ranks.decide_on_primary(lambda: claimant.claim(attempt_id, held, holdings), "claiming the run directory")
    memory.bind(claim.identity)
    return settle(claimant, ranks, claim, holdings) if claim.memory else claim


def settle(claimant: Claimant, ranks: Coordinator, claim: Claim, holdings: list[Holding]) -> Claim:
    """Every rank verifies its own part of the chosen tier-0 generation. When every rank whose
    part is missing (a replaced node) or damaged has a replica on another rank (several nodes),
    they fetch them from those partners; when some part still cannot serve, rank 0 restores the
    newest earlier durable generation instead. Every rank learns the same outcome."""
    memory, started, name, attempt = claimant.memory, time.monotonic(), claim.memory, claim.memory_attempt
    problems = {rank: problem for rank, problem in enumerate(ranks.gather(memory.problem(name, attempt),
                                                                            f"verifying tier 0's {name}")) if problem}
    if problems and ranks.distributed and all(replicated(holdings, rank, name, attempt) for rank in problems):
        if ranks.is_primary:
            for rank in sorted(problems):
                log.warning("tier 0 of rank %d cannot serve %s (%s): fetching the replica its partner keeps",
                            rank, name, problems[rank])
        fetched = ranks.gather(memory.fetch(ranks.background(), name, attempt, set(problems)), f"fetching {name} from peers")
        failed = {rank: f"{problems[rank]}; its replica: {fetched[rank]}" for rank in problems if fetched[rank]}
    else:
        failed = problems
    if failed:
        return ranks.decide_on_primary(lambda: claimant.instead_of(claim, failed), "restoring a durable generation")
    generation = memory.restorable(name)
    return replace(claim, generation=generation, verify_s=claim.verify_s + time.monotonic() - started,
                   manifest_sha256=manifest_digest(generation.path), tier=PEER if problems else MEMORY)


def replicated(holdings: list[Holding], rank: int, name: str, attempt: str) -> bool:
    """Another rank keeps a replica of `rank`'s part of `name`, written by `attempt`."""
    return any(holding.parts.get(rank, (None, {}))[1].get(name) == attempt for holding in holdings
               if holding.rank != rank)
