"""Stop signals in a DataLoader worker: the trainer decides when its run stops, and its own
SIGTERM still ends the worker."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass


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
