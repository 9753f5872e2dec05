"""A plain loop under torchrun whose model is or is not one model across the ranks, for
tests/test_replicas.py (trainer/run/replicas.py):

- `unwrapped`: the model is never wrapped in DistributedDataParallel, so each rank trains its own;
- `by_hand`: the script all-reduces the gradients itself (equal replicas), with a BatchNorm whose
  running statistics differ per rank and an RNG drawn a rank's number of times (both legitimate),
  saving every 2 steps; with `drift` the last rank's weights change in step 3 (a replica that
  parts after the first step's check: the save at step 4 sees it).

    python own_loop_replicas.py RUN_DIR MODE [drift]   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

from trainer import recovery

mode, drift = sys.argv[2], sys.argv[3:] == ["drift"]
recovery.seed_everything(0)
inputs = torch.randn(48, 4)
dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
with recovery.open_run(sys.argv[1], recover=recovery.CadenceConfig(every_steps=2)) as run:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.restore(model, optimizer, data=recovery.KeyedData(dataset, batch_size=12))
    for epoch in run.epochs(1):
        for x, y in run.batches():
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            if mode == "by_hand":
                for parameter in model.parameters():
                    dist.all_reduce(parameter.grad)
                    parameter.grad /= run.world_size
                torch.rand(run.rank + 1)  # each rank's RNG its own
            optimizer.step()
            if drift and run.progress.global_step == 2 and run.rank == run.world_size - 1:
                with torch.no_grad():
                    model[0].weight[0, 0] += 1.0
            run.step(loss)
