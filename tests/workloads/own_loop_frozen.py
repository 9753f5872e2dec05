"""A plain DDP loop in the script's own process group (`init_process_group` before `open_run`,
as a framework does), for tests/test_peer_silence.py: after step 3, rank 1 says `waiting` on
stdout and waits for a line on stdin, so the test freezes it (SIGSTOP) at a known point, while
rank 0 waits for it in step 4's gradient reduction. The fallback bound is torch's 30 minutes:
only the silence (--peer-silence-secs, here `SILENCE_S` seconds) can end rank 0's wait.

    python own_loop_frozen.py RUN_DIR   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer import recovery

dist.init_process_group("gloo")
recovery.seed_everything(0)
inputs = torch.randn(48, 4)
dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(1, keepdim=True))
model = nn.Linear(4, 1)
bound = recovery.PeerWaitConfig(timeout_s=1800.0, silence_s=float(os.environ["SILENCE_S"]))
with recovery.open_run(sys.argv[1], peer_wait=bound) as run:
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.restore(model, optimizer, data=recovery.KeyedData(dataset, batch_size=4))
    for epoch in run.epochs(1):
        for x, y in run.batches():
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
            if run.progress.global_step == 3 and run.rank == 1:
                print("waiting", flush=True)
                sys.stdin.readline()
