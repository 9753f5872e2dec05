"""A script that creates its own process group (`init_process_group("gloo")`, `env://`, as a
framework does) under `torchrun --max-restarts 1`, for tests/test_rejoin.py. Round 0: both
ranks join, then rank 1 dies by kill -9 and the agent restarts both. Round 1: rank 1 starts its
join only once rank 0 has started its own (`PROBE_MARK`: a file rank 0 creates) and a moment
more, the order in which torch's unkeyed `env://` hands rank 0 the dead rank 1's address.
`PROBE_KEYED=1` imports the library first, as a script using it does (`trainer.recovery`
keys `env://` by round under torchrun; so does `-m trainer.launch`). Each round's ranks say
`round R rank N joined`, whether a warm spare forked them, and their argv."""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

if os.environ.get("PROBE_KEYED") == "1":
    from trainer import recovery  # noqa: F401

rank, round_ = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
mark = Path(os.environ["PROBE_MARK"])
if round_ == 1:
    if rank == 0:
        mark.touch()
    else:
        while not mark.exists():
            time.sleep(0.01)
        time.sleep(float(os.environ.get("PROBE_LATER_S", "1")))  # rank 0 reads the store meanwhile
dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("PROBE_TIMEOUT_S", "20"))))
total = torch.ones(1)
dist.all_reduce(total)
print(f"round {round_} rank {rank} joined ({total.item():g}) warm={'TRAINER_WARM_SPARE_FRONT' in os.environ} "
      f"argv={','.join(sys.argv)}", flush=True)
if round_ == 0 and rank == 1:
    os.kill(os.getpid(), 9)
dist.barrier()
dist.destroy_process_group()
sys.exit(0)
