"""The process around the training: which device, and the determinism settings every attempt
must share (how DataLoader workers treat stop signals: trainer/data/workers.py)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from trainer import compat
from trainer.config import RunConfig
from trainer.parallel.ranks import rank_seed
from trainer.errors import UsageError


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    return torch.device(requested)


def configure_determinism(config: RunConfig, rank: int = 0) -> None:
    """Same algorithms, same thread count, same seeds: the precondition for bit-equality."""
    if config.allow_nondeterministic_ops:
        compat.use_deterministic_algorithms(warn_only=True)  # before seeding: it stays
    seed_everything(config.workload.seed, config.workload.threads, rank)


def seed_everything(seed: int, threads: int, rank: int = 0) -> None:
    """Deterministic algorithms, `threads` intra-op threads, and Python's, NumPy's and torch's
    global RNGs seeded from (seed, rank) (`recovery.seed_everything` for a user's own loop)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    compat.use_deterministic_algorithms()
    torch.set_num_threads(threads)
    seed = rank_seed(seed, rank)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
