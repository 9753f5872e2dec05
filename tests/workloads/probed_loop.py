"""A plain own loop through `trainer.recovery` with the step probe on (tests/step_probe.py),
for tests/test_step_path.py: DDP under torchrun, 8 steps, no save before the last.

    python probed_loop.py RUN_DIR PROBE_OUT
"""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the probe
import step_probe  # noqa: E402

from trainer import recovery  # noqa: E402

recovery.seed_everything(0)
inputs = torch.randn(48, 4)
dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
with recovery.open_run(sys.argv[1], recover=recovery.CadenceConfig(every_steps=1000)) as run:
    trained = DistributedDataParallel(model) if run.world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.restore(trained, optimizer, data=recovery.KeyedData(dataset, batch_size=6))
    probe = step_probe.install(sys.argv[2])
    for epoch in run.epochs(1):
        for x, y in run.batches():
            probe.window()
            loss = nn.functional.mse_loss(trained(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
