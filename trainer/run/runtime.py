"""The process around the training: which device, the determinism settings every attempt
must share, and how DataLoader workers treat stop signals."""

from __future__ import annotations

import os
import random
import signal
import threading
from dataclasses import dataclass

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


@dataclass(frozen=True)
class WorkerSignals:
    """How a DataLoader worker treats stop signals (its `worker_init_fn`).

    A SIGTERM/SIGINT sent to the whole process group (scancel, `kill -TERM -PGID`, Ctrl-C)
    is meant for the trainer, which finishes its step, saves and exits 75, then stops its
    workers: a worker it reaches first must not die mid-batch. But the trainer's own SIGTERM
    must still end a worker: at interpreter exit, multiprocessing terminates the workers of a
    loader that was never shut down (an attempt that failed while they were running) and waits
    for each; a worker that ignored it hung the trainer for good (issue #30). So SIGINT is
    ignored, and SIGTERM is received by a thread that ends the worker when the trainer sent it
    and drops it otherwise. `trainer` is the training process's pid, taken when the loader is
    made (a worker's parent is not it under the forkserver start method)."""

    trainer: int

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # inherited by the thread below
        threading.Thread(target=self.obey_the_trainer, name="stop-signals", daemon=True).start()

    def obey_the_trainer(self) -> None:
        while True:
            sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
            if sender == self.trainer:
                # Exit 0: the trainer's DataLoader counts a worker that died of a signal as a
                # failure of its own, which would add a second error to the one being reported.
                os._exit(0)
