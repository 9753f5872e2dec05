"""Run configuration as frozen dataclasses: the one source of every default.

`cli.py` (with `flags.py`, which takes every option's default from here) is the one place
that turns command-line options into these objects; everything
below it receives plain, immutable values. Which fields are *training-relevant* (and so part
of the fingerprint) is decided here, next to the fields themselves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from trainer.errors import option
from trainer.location import Location

CHECKPOINT_MODES = ("auto", "sync", "async")


DEFAULT_WORKLOAD = "trainer.workload.example:ExampleWorkload"
"""`--workload MODULE:FACTORY` when none is given: the example MLP."""

FIXED_BUCKET_MB = 25
"""Megabytes of gradients per bucket of the `fixed-buckets` reduction (DDP's own default size):
big enough that a collective's latency is small beside its transfer, small enough that the
first buckets are sent while backward still runs. Not an option: which gradients share a
bucket decides the bits, so a run keeps it for its whole life."""
FIRST_FIXED_BUCKET_MB = 1
"""The first bucket's (of each dtype): the last layers' gradients, sent as soon as backward
made them, as DDP sends its first (`dist._DEFAULT_FIRST_BUCKET_BYTES`). With DDP's default
sizes the plan is the layout DDP rebuilds for a sequential model: its buckets are then sent
without a copy (trainer/parallel/reduction.py)."""

UNNAMED_REDUCTION = "per-parameter"
"""The reduction of a generation whose fingerprint names none: the default when it was written
(before `fixed-buckets`), left out of `config` as every default is."""


@dataclass(frozen=True)
class WorkloadConfig:
    """What is trained and how: the trainer's own training options, and the workload with the
    options it declared. Every field except `epochs`, `max_steps` and `num_workers` changes
    what is trained, so they are fingerprinted; those may change between attempts."""

    epochs: int = 8
    """Total epochs. Extending a finished run with a larger value is allowed on resume."""
    max_steps: int | None = None
    """Total optimizer steps, counted across epochs (a stream's step budget); when set it
    decides the run's length instead of `epochs`. Extending it is allowed on resume."""
    batch_size: int = 16
    """Samples per batch (per micro-batch under --grad-accum), across all processes."""
    seed: int = 1234
    num_workers: int = 0
    """DataLoader worker processes. Every fetch runs with the global RNGs seeded from
    (seed, epoch, index) (trainer/data/fetching.py), so this does not change training and may
    differ between attempts."""
    amp: bool = False
    """Mixed precision (bfloat16 autocast on CPU, float16 + GradScaler on CUDA)."""
    threads: int = 1
    """Intra-op CPU threads. Fixed so reductions run in the same order on resume."""
    data_parallel: str = "ddp"
    """ddp | fsdp: how several torchrun processes share the model. Workload-level (and so
    fingerprinted) because it changes the trained bits and the stored layout: FSDP2 reduces
    gradients by reduce-scatter instead of all-reduce, and each rank holds and saves only its
    shard of every parameter and optimizer buffer. A resume must keep the choice (or allow
    `config` drift, giving up exactness)."""
    gradient_reduction: str = "fixed-buckets"
    """fixed-buckets | per-parameter | bucketed: how DDP sums gradients across ranks
    (trainer/parallel/reduction.py). `fixed-buckets` all-reduces flat buckets of a fixed
    composition (`FIXED_BUCKET_MB` each), one collective per bucket overlapping backward, so a
    resumed run is bit-exact at any world size; `per-parameter` (exact too) all-reduces each
    gradient on its own, one collective per parameter; `bucketed` is DDP's own all-reduce of
    its buckets, whose layout changes after the first step: exact only up to 2 processes.
    Fingerprinted: each gives different bits. A resume that does not name one keeps its
    generation's (`kept_reduction`)."""
    shuffle_buffer: int = 1024
    """Streaming data only: records per shuffle block (trainer/data/stream.py). Larger mixes
    more; a resume re-reads up to one block, and each reader holds one in memory."""
    stream_lanes: int | None = None
    """Streaming data only: the lanes each epoch is laid out in (trainer/data/stream.py), fixed
    for the run, so the order is the same at every world size. None: the world size the run
    starts with. Each rank reads the lanes its slots fall in: once per epoch when the world
    size divides the lanes, so a count with many divisors (12, 24, 48) keeps a change cheap."""
    last_batch: str = "pad"
    """pad | drop | refuse: an epoch's ragged last batch (trainer/data/order.py). `pad` trains
    it, each rank's loss weighted by its share (a rank with none repeats a sample at weight 0);
    `drop` leaves it untrained; `refuse` stops a run whose processes cannot share it evenly."""
    grad_accum: int = 1
    """Micro-batches per optimizer step. Steps, cadence and the LR schedule count optimizer
    steps; saves and preemption stops happen only between them, so no generation holds
    partial gradients. An epoch's last window may be shorter (windows never span epochs)."""
    workload: str = DEFAULT_WORKLOAD
    """MODULE:FACTORY of the workload (see trainer/workload/protocol.py)."""
    options: tuple[tuple[str, object], ...] = ()
    """The workload's own options (name, value), as it declared and the command line set
    them; empty means the workload's defaults."""
    given: frozenset[str] = frozenset()
    """Which of `batch_size`, `num_workers` and `gradient_reduction` the command line set: a
    DataLoader returned by `build_dataset` fills the others (trainer/workload/adapters.py
    `from_loader`), and one given that disagrees with the loader's batch size is refused; a
    resume keeps its generation's reduction unless one is given (`kept_reduction`). Not
    fingerprinted: the values it decides are."""
    loader_settings: frozenset[str] = frozenset()
    """Which of `batch_size` and `num_workers` an adopted DataLoader set (the others came from
    the command line or the defaults), so that a line about one names where it came from
    (`named`). Not fingerprinted."""

    def named(self, name: str) -> str:
        """`batch_size` or `num_workers` as an error line names it: the loader's setting, or
        the flag (given, or its default)."""
        value = getattr(self, name)
        if name in self.loader_settings:
            return f"the loader's {name}={value}"
        return option(f"--{name.replace('_', '-')}", value)

    def training_relevant(self) -> dict:
        """The options whose change alters the trained bits (fingerprint `config`): the
        trainer's and every option the workload declared."""
        values = {name: value for name, value in asdict(self).items()
                  if name not in ("epochs", "max_steps", "num_workers", "options", "given", "loader_settings")}
        # Leaving a default out keeps the fingerprints of generations written before the
        # option existed equal, so they still resume without drift. A reduction is left out
        # when it is the one a fingerprint without it means (the default when it was written).
        for name, default in (("data_parallel", "ddp"), ("gradient_reduction", UNNAMED_REDUCTION), ("grad_accum", 1),
                              ("workload", DEFAULT_WORKLOAD), ("shuffle_buffer", 1024),
                              ("last_batch", "pad"), ("stream_lanes", None)):
            if values[name] == default:
                values.pop(name)
        return {**values, **dict(self.options)}

    def kept_reduction(self, stored: dict) -> WorkloadConfig:
        """These settings to resume a generation whose fingerprint `config` is `stored`: the
        generation's own gradient reduction (`UNNAMED_REDUCTION` where it names none), unless
        the command line named one (then a different one is the fingerprint's to refuse). A
        resume never changes its reduction by a change of default: a run begun with
        `per-parameter` goes on with it, bit-exact."""
        if "gradient_reduction" in self.given or not isinstance(stored, dict):
            return self
        return replace(self, gradient_reduction=stored.get("gradient_reduction", UNNAMED_REDUCTION))


@dataclass(frozen=True)
class AutoCadenceConfig:
    """`--recover-every-secs auto`: the interval follows the measured save cost and the run's
    failure rate (Daly's form, trainer/run/interval.py), within these bounds. Never
    fingerprinted: it changes when saves happen, never what is trained."""

    min_s: float = 30.0
    """Shortest interval, and the starting one while no save cost is known. Lower it when saves
    are cheap and failures frequent (each save blocks the loop for C seconds)."""
    max_s: float = 3600.0
    """Longest interval: bounds the work one failure can cost when failures are rare."""
    assume_mtbf_s: float | None = None
    """Mean time between failures to plan with while the run has seen fewer than 3 (for example
    the cluster's known rate). None: the run's own history, as a lower bound."""


TIER0_AUTO = AutoCadenceConfig(min_s=1.0, max_s=600.0)
"""Tier 0's auto bounds unless given (`--memory-auto-min-secs`, `--memory-auto-max-secs`): a
tier-0 save is cheap, so never more often than every second, and at least every ten minutes."""


@dataclass(frozen=True)
class CadenceConfig:
    """When each save path fires. Any trigger that is set fires (an "any of" policy)."""

    every_epochs: int | None = None
    every_steps: int | None = None
    every_s: float | None = None
    auto: AutoCadenceConfig | None = None
    """Recovery only: `--recover-every-secs auto`, a seconds trigger whose interval is derived
    from measurements, within these bounds (AutoCadenceConfig's defaults unless given)."""


@dataclass(frozen=True)
class ProgressConfig:
    """How often a progress line is logged when stdout is not a terminal (on a terminal a
    status line is redrawn instead). Not training-relevant: never fingerprinted."""

    every_steps: int = 10
    """A line every N global steps (1: every step)."""
    every_s: float = 60.0
    """Also a line when this many seconds passed since the previous one (slow steps)."""


@dataclass(frozen=True)
class RetentionConfig:
    keep_last: int = 3
    """Newest verified recovery generations kept. Keep at least 2 on a cluster: the newest
    may not have reached durable storage when a node dies."""
    keep_every: int | None = None
    """Also keep generations whose step is a multiple of this (long-term milestones)."""
    keep_exports: int | None = None
    """Newest exports kept; None keeps all."""


@dataclass(frozen=True)
class WaitBound:
    """A wait for another rank, bounded by what was measured: `factor` times the slowest
    measured duration, at least `floor_s`, `first_s` before anything was measured, or a fixed
    `timeout_s`. The two kinds of collective (the training group's, a background save's) each
    set their own numbers in a subclass."""

    timeout_s: float | None = None
    floor_s: float = 0.0
    factor: float = 1.0
    first_s: float = 0.0

    def bound_s(self, slowest_s: float | None) -> float:
        """Seconds a collective may wait, given the slowest duration measured so far."""
        if self.timeout_s is not None:
            return self.timeout_s
        if slowest_s is None:
            return self.first_s
        return max(self.floor_s, self.factor * slowest_s)


@dataclass(frozen=True)
class BackgroundWaitConfig(WaitBound):
    """How long a background collective (an async save's DCP planning and final gather, its
    commit's agreement, each on a gloo group of its own) waits for a peer before it fails.
    torch's default is 30 minutes: a rank whose staging or writer thread failed kept the
    others waiting that long. Never fingerprinted."""

    timeout_s: float | None = None
    """`--background-timeout-secs`: a fixed bound; None (auto) derives it from the saves measured."""
    floor_s: float = 120.0
    """The least an auto bound allows: scheduling noise, a slow store request retried."""
    factor: float = 4.0
    """An auto bound is this many times the slowest save of this attempt (write + commit)."""
    first_s: float = 600.0
    """An auto bound before any save was measured (the first save, which also warms caches)."""


@dataclass(frozen=True)
class PeerWaitConfig(WaitBound):
    """How long a rank waits for its peers in the training group's collectives (the step's
    agreement, DDP's gradient reduction, a sync save's barriers, rank 0's decisions) before
    the attempt ends, resumable (75), naming the rank that did not answer. torch's default is
    30 minutes: a frozen rank (a hung GPU, a silent NIC, a paused VM) held the job that long.
    The auto bound follows what this rank measured between two steps' agreements: a step
    without a save, and a step with one, each bounded by its own kind (parallel/ranks.py).
    Never fingerprinted."""

    timeout_s: float | None = None
    """`--peer-timeout-secs`: a fixed bound; None (auto) derives it from the steps measured."""
    floor_s: float = 30.0
    """The least an auto bound allows: a garbage collection, a slow progress line, a noisy
    neighbour; raise it where a step's time varies more than `factor` allows."""
    factor: float = 10.0
    """An auto bound is this many times the slowest step (or save step) measured so far."""
    first_s: float = 1800.0
    """Before a step of that kind was measured: joining, rank 0's claim and verification, the
    build, the restore, a compile, the first save. torch's own default, so nothing that worked
    before times out now (a frozen or dead peer is found by its silence meanwhile)."""
    silence_s: float = 8.0
    """`--peer-silence-secs`: a peer whose heartbeat (a counter bumped every 0.3 s on a thread of
    its own) has not moved for this long is frozen or dead, and every rank ends (75) naming it,
    whatever it waits in, whatever the step time. Well above what makes a living rank's beat late
    on a loaded machine (docs/scale-out.md measures it: under 1 s); lower it for a faster
    detection on quiet hosts, raise it where a process can stall longer (swap)."""
    rejoin_s: float = 120.0
    """`--rejoin-timeout-secs`: how long a round restarted by torchrun's agent (`--max-restarts`)
    waits for every rank to join. The first round waits `first_s` (pods may take minutes to be
    scheduled); a restarted round's peers are restarted by their agents within seconds, plus the
    agent's 30 s grace for a worker frozen on another node."""

    def join_bound_s(self, restart: int) -> float:
        """The bound of joining round `restart` (0: the first) of the launcher's restarts."""
        return self.rejoin_s if restart else self.first_s


@dataclass(frozen=True)
class StoreConfig:
    """How hard to try before a store operation fails the run (exit 74), and how far the
    background uploads may fall behind the saves."""

    retries: int = 4
    """Retries of one operation after its first try (so 5 tries in all)."""
    backoff_s: float = 0.5
    """First wait between tries; doubles each retry, capped at 8 s."""
    timeout_s: float = 20.0
    """Connect and read timeout of one request."""
    max_pending_uploads: int = 2
    """Generations published locally and not yet committed in the store (uploading or
    queued). A save that would exceed it waits (back-pressure, counted as blocked time);
    0 makes every save wait until it is durable."""
    lease_ttl_s: float = 30.0
    """How long the single-writer lease lasts without a renewal (renewed every third of it)."""
    lease_wait_s: float | None = None
    """How long a new trainer waits for a held lease to expire before exit 73 (None: the
    holder's ttl plus a margin, so a dead holder's lease is taken over unattended)."""


@dataclass(frozen=True)
class MemoryTierConfig:
    """Tier 0 (trainer/storage/memory/): generations in a directory on a memory filesystem,
    outside the process, on a cadence of their own. Never fingerprinted: it changes when and
    where saves happen, never what is trained."""

    directory: Path | None = None
    """`--memory-dir`: a directory on a memory filesystem (/dev/shm/…, an emptyDir with
    `medium: Memory`); None: no tier 0."""
    every_steps: int | None = 10
    """A tier-0 generation every N optimizer steps (steps where a durable one is saved skip it);
    None with `auto`."""
    auto: AutoCadenceConfig | None = None
    """`--memory-every-steps auto`: N follows tier 0's measured save cost and the run's failure
    rate (Daly, in steps at the attempt's step time; trainer/run/cadence.py `AutoSteps`), within
    these bounds (`TIER0_AUTO`'s unless given)."""
    keep: int = 2
    """Newest tier-0 generations kept (K); a save prunes to K - 1 before it writes."""
    max_bytes: int | None = None
    """What tier 0 (K generations) plus the staging buffers of async saves may use; None: what
    the memory filesystem holds free (an emptyDir's `sizeLimit`)."""


@dataclass(frozen=True)
class SigningConfig:
    """Authenticated generations (trainer/checkpoint/signing.py). Not training-relevant."""

    key_file: Path | None = None
    """A file holding the HMAC key (a mounted Secret); None: generations are not signed and
    signatures are not checked. The key itself is never an option value."""
    allow_unsigned: bool = False
    """With a key: also accept unsigned generations (adopting a run that started before
    signing); recorded in the attempt."""


@dataclass(frozen=True)
class WriterConfig:
    """How recovery snapshots are written (trainer/checkpoint/writer.py). The defaults were
    measured on a 2-core VM with virtio storage (bench/checkpoint_bench.py); re-measure before
    changing them."""

    threads: int = 4
    """Files written concurrently. More than the core count still helps: a thread blocked
    in fsync leaves its core to another thread's hashing. Each thread holds one file open."""
    early_writeback: bool = True
    """Start writing each range to disk as soon as it is in the page cache (Linux), rather
    than all at the final fsync. Turn off only to measure what it buys."""
    zip_crc32: bool = False
    """Let torch.save compute a CRC-32 per tensor record. Redundant with the manifest's
    digest and costs about a quarter of the CPU time of a write; turn it on only if a tool
    of yours checks zip CRCs."""


@dataclass(frozen=True)
class RunConfig:
    location: Location
    """Where the run directory lives: on this disk, or in an object store with this machine's
    local tier (trainer/location.py)."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    interrupt_at_step: int | None = None
    resume: str | None = None
    """None (fresh start only), "latest" (must resume) or "auto" (resume if possible)."""
    from_generation: str | None = None
    adopt_from: tuple[str, ...] = ()
    """Runs whose generations this run may restore (an operator's deliberate choice, recorded
    in the run directory's run.json): a generation of any other run is refused (65)."""
    allow_drift: tuple[str, ...] = ()
    checkpoint_mode: str = "auto"
    """auto | sync | async; auto is async on CUDA and sync on CPU (`effective_mode`: on CPU the
    background write needs a core the loop does not use, and the staged copy doubles the
    state's host memory; docs/checkpoint-modes.md)."""
    device: str = "auto"
    data_parallel_backend: str = "auto"
    """`--data-parallel-backend`: auto is NCCL on CUDA and gloo on the CPU. gloo on CUDA lets
    several processes share one GPU (NCCL refuses two ranks on one device): a check or a test on
    one GPU, at gloo's speed. Fingerprinted with the device (`fingerprint.device_kind`): the
    backend's reduction order is part of the trained bits."""
    recover: CadenceConfig = field(default_factory=lambda: CadenceConfig(every_epochs=1))
    export: CadenceConfig = field(default_factory=CadenceConfig)
    export_dtype: str | None = None
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    background_wait: BackgroundWaitConfig = field(default_factory=BackgroundWaitConfig)
    peer_wait: PeerWaitConfig = field(default_factory=PeerWaitConfig)
    preempt_grace_s: float = 20.0
    """On SIGTERM/SIGINT, time allowed to save before exiting 75 without publishing."""
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    max_failed_attempts: int = 3
    """Stop (exit 70) when this many attempts in a row restored the same generation and died
    before publishing a newer one; 0 disables the check."""
    store_config: StoreConfig = field(default_factory=StoreConfig)
    signing: SigningConfig = field(default_factory=SigningConfig)
    memory: MemoryTierConfig = field(default_factory=MemoryTierConfig)
    warm_spare: bool = True
    """`--warm-spare`: under torchrun with `--max-restarts`, the node's first worker keeps a
    forked copy of itself with every import done, and a restarted worker is forked from it
    instead of importing torch again (trainer/parallel/spare.py; docs/scale-out.md): about 2.5 s
    less per restart, for the spare's memory (what the worker changes after the fork, up to the
    imports' 300 MB per node). Never fingerprinted."""
    allow_nondeterministic_ops: bool = False
    """`--allow-nondeterministic-ops`: an op without a deterministic implementation on this device
    (common CUDA backward kernels: interpolate, grid_sample, pooling, CTC loss) warns instead of
    ending the run in one line naming it; the attempt is then recorded as not promised exact.
    Never fingerprinted."""
    argv: tuple[str, ...] = ()
