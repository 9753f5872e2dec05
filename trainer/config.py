"""Run configuration as frozen dataclasses.

`cli.py` is the one place that turns command-line options into these objects; everything
below it receives plain, immutable values. Which fields are *training-relevant* (and so part
of the fingerprint) is decided here, next to the fields themselves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

CHECKPOINT_MODES = ("auto", "sync", "async")


@dataclass(frozen=True)
class WorkloadConfig:
    """The example workload. Every field except `epochs` and `num_workers` changes what is
    trained, so they are fingerprinted; those two may change between attempts."""

    epochs: int = 8
    """Total epochs. Extending a finished run with a larger value is allowed on resume."""
    samples: int = 128
    """Size of the generated dataset; with batch_size 16 that is 8 batches per epoch."""
    batch_size: int = 16
    lr: float = 0.05
    """Initial learning rate (SGD with momentum, decayed per step, independent of epochs)."""
    seed: int = 1234
    hidden_size: int = 64
    """Width of the hidden layers; raise it (with `layers`) to make checkpoints bigger."""
    layers: int = 2
    dropout: float = 0.1
    features: int = 16
    classes: int = 4
    num_workers: int = 0
    """DataLoader worker processes. Per-sample randomness derives from (seed, epoch, index),
    so this does not change training and may differ between attempts."""
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

    def training_relevant(self) -> dict:
        """The options whose change alters the trained bits (fingerprint `config`)."""
        values = asdict(self)
        for name in ("epochs", "num_workers"):
            values.pop(name)
        if values["data_parallel"] == "ddp":
            # The layout of every generation written before the option existed: leaving the
            # default out keeps their fingerprints equal, so they still resume without drift.
            values.pop("data_parallel")
        return values

    @property
    def batches_per_epoch(self) -> int:
        return -(-self.samples // self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.batches_per_epoch


@dataclass(frozen=True)
class CadenceConfig:
    """When each save path fires. Any trigger that is set fires (an "any of" policy)."""

    every_epochs: int | None = None
    every_steps: int | None = None
    every_secs: float | None = None


@dataclass(frozen=True)
class ProgressConfig:
    """How often a progress line is logged when stdout is not a terminal (on a terminal a
    status line is redrawn instead). Not training-relevant: never fingerprinted."""

    every_steps: int = 10
    """A line every N global steps (1: every step)."""
    every_secs: float = 60.0
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
class RunConfig:
    output: Path | None
    """The run directory. None on the non-primary ranks of a tracked multi-process run: they
    use the outputs path rank 0's tracking run was given."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    interrupt_at_step: int | None = None
    resume: str | None = None
    """None (fresh start only), "latest" (must resume) or "auto" (resume if possible)."""
    from_generation: str | None = None
    allow_drift: tuple[str, ...] = ()
    checkpoint_mode: str = "auto"
    """auto | sync | async; auto is async on CUDA and sync on CPU."""
    device: str = "auto"
    recover: CadenceConfig = field(default_factory=lambda: CadenceConfig(every_epochs=1))
    export: CadenceConfig = field(default_factory=CadenceConfig)
    export_dtype: str | None = None
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    preempt_grace_secs: float = 20.0
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    max_failed_attempts: int = 3
    """Stop (exit 70) when this many attempts in a row restored the same generation and died
    before publishing a newer one; 0 disables the check."""
    argv: tuple[str, ...] = ()
