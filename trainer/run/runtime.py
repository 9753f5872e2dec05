"""The process around the training: which device, the determinism settings every attempt
must share, and how DataLoader workers treat stop signals."""

from __future__ import annotations

import os
import random
import signal

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
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    compat.use_deterministic_algorithms()
    torch.set_num_threads(config.workload.threads)
    seed = rank_seed(config.workload.seed, rank)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM/SIGINT to the main process (which saves and exits
    75, then stops them); a process-group SIGTERM must not kill them mid-batch first."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
