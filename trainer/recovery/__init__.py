"""Recovery inside your own training loop (docs/library.md).

    from trainer import recovery

    with recovery.open_run("runs/a", resume="auto") as run:
        run.restore(model, optimizer, scheduler, data=recovery.KeyedData(dataset, batch_size=32))
        for epoch in run.epochs(8):
            for batch in run.batches():
                ...  # forward, backward, optimizer.step(), scheduler.step()
                run.step(loss)

The same generations, manifests and attempt records as `python -m trainer`: `list`, `verify`,
`report` and `compare.py` read them unchanged. Options are RunConfig's fields
(trainer/config.py), with the command line's defaults.
"""

import os as _os

from trainer.origin import require_ours

require_ours()  # before any other import: under a foreign `trainer`, one line instead of a puzzle

from trainer.config import (CadenceConfig, MemoryTierConfig, PeerWaitConfig, RetentionConfig, RunConfig, SigningConfig,
                            StoreConfig)
from trainer.recovery.run import KeyedData, RecoveryRun, Stopped, open_run
from trainer.run.runtime import seed_everything as _seed_everything
from trainer.run.state import capture_rng, restore_rng
from trainer.parallel.rendezvous import install_under_torchrun as _install_under_torchrun

_install_under_torchrun(_os.environ)  # a group the script or its framework creates rejoins after a restart in place


def seed_everything(seed: int, threads: int = 1) -> None:
    """What the trainer does before building anything: deterministic algorithms, a fixed number
    of CPU threads, and Python's, NumPy's and torch's RNGs seeded. Call it first: an RNG left
    unseeded starts from the OS's entropy, so two fresh runs (and a resumed one) differ there."""
    _seed_everything(seed, threads)

__all__ = ["CadenceConfig", "KeyedData", "MemoryTierConfig", "PeerWaitConfig", "RecoveryRun", "RetentionConfig", "RunConfig", "SigningConfig", "Stopped",
           "StoreConfig", "capture_rng", "open_run", "restore_rng", "seed_everything"]
