"""Recovery in your own PyTorch loop on several processes (docs/library.md): DDP or FSDP2 under
torchrun, surviving kill -9 of any rank and SIGTERM, resuming bit for bit at the same world size:

    torchrun --nproc_per_node 2 examples/own_loop_ddp.py runs/own-loop-ddp
    torchrun --nproc_per_node 3 examples/own_loop_ddp.py runs/own-loop-fsdp --data-parallel fsdp
    torchrun --nproc_per_node 3 examples/own_loop_ddp.py runs/own-loop-stream --stream

`open_run` joins the process group torchrun describes (or uses the one your script already
created with `init_process_group`); wrap the model after it, build the optimizer on the wrapped
model, then `restore`, with what the loop holds between steps (`extras`: each rank's own). No
logging set up here: `open_run` still says on stderr what it restored.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainer import recovery


def wrapped(model: nn.Module, how: str) -> nn.Module:
    """The model as the processes share it: DDP (every rank the whole model) or FSDP2 (each
    layer sharded across the ranks, then the root)."""
    if not dist.is_initialized():  # one process
        return model
    if how == "ddp":
        return DistributedDataParallel(model)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    return fully_shard(model)


class Shards:
    """The samples as a stream: shards read from an offset, as files on a disk or objects in a
    bucket are (`shards()` names them and their records, `read` reads one from a record on).
    KeyedData owns the order, the shuffle and the cursor; a resume reads from the cursor."""

    def __init__(self, dataset, size: int = 25):
        self.dataset, self.size = dataset, size

    def shards(self):
        return [(f"part-{start // self.size}", len(range(start, min(start + self.size, len(self.dataset)))))
                for start in range(0, len(self.dataset), self.size)]

    def read(self, shard, offset):
        start = int(shard[0].removeprefix("part-")) * self.size
        return (self.dataset[at] for at in range(start + offset, start + shard[1]))


class Between:
    """What this loop holds from one step to the next, handed over as `extras` (each rank its
    own, restored to the same rank): the input noise of the next step, drawn from this rank's
    own generator before the step ends (as a loader that prefetches draws its next batch), and
    the best loss so far, which only rank 0 computes."""

    def __init__(self, rank: int):
        self.generator = torch.Generator().manual_seed(1000 + rank)
        self.noise = self.drawn()
        self.best = float("inf")

    def drawn(self) -> torch.Tensor:
        return 0.01 * torch.randn(1, 16, generator=self.generator)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "noise": self.noise,
                "best": torch.tensor(self.best, dtype=torch.float64)}

    def load_state_dict(self, stored: dict) -> None:
        self.generator.set_state(stored["generator"])
        self.noise, self.best = stored["noise"].clone(), float(stored["best"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output", help="the run directory (a path every rank sees, or s3://bucket/run)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--data-parallel", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--memory-dir", type=Path, help="tier 0: a directory on a memory filesystem (/dev/shm/...)")
    parser.add_argument("--checkpoint-mode", choices=("auto", "sync", "async"), default="auto",
                        help="async: staged in memory, written in the background (auto: async on CUDA)")
    parser.add_argument("--stream", action="store_true",
                        help="read the samples as a stream of shards in 6 lanes (one order at 1, 2, 3 or 6 processes)")
    parser.add_argument("--init-first", action="store_true",
                        help="join the process group before open_run, as a framework does (open_run then uses it)")
    args = parser.parse_args()
    if args.init_first:
        dist.init_process_group("gloo")

    recovery.seed_everything(0)  # the same seed on every rank: every rank builds the same model
    inputs = torch.randn(100, 16)  # 8 batches of 12 and a ragged one of 4 per epoch
    dataset = torch.utils.data.TensorDataset(inputs, inputs @ torch.randn(16, 1) + 0.1 * torch.randn(100, 1))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    memory = recovery.MemoryTierConfig(args.memory_dir, every_steps=1) if args.memory_dir else recovery.MemoryTierConfig()

    with recovery.open_run(args.output, resume="auto", recover=recovery.CadenceConfig(every_steps=4),
                           memory=memory, checkpoint_mode=args.checkpoint_mode) as run:
        model = wrapped(model, args.data_parallel)  # wrap, then build the optimizer, then restore
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * 9)
        data = recovery.KeyedData(Shards(dataset), batch_size=12, seed=0, stream_lanes=6) if args.stream else \
            recovery.KeyedData(dataset, batch_size=12, seed=0)
        between = Between(run.rank)
        progress = run.restore(model, optimizer, scheduler, data=data, extras={"between": between})
        if run.rank == 0:
            print(f"from step={progress.global_step} epoch={progress.epoch} position={progress.position}", flush=True)
        for epoch in run.epochs(args.epochs):
            for x, y in run.batches():  # this rank's share of each global batch of 12
                x, between.noise = x + between.noise, between.drawn()  # the next step's, drawn ahead
                loss = nn.functional.mse_loss(model(x), y) * run.weight  # the ragged last batch's share
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                if run.rank == 0:  # before run.step: a generation it saves holds this step's best too
                    between.best = min(between.best, loss.item())
                run.step(loss)  # the witness, saves on cadence; SIGTERM to any rank: all save, exit 75
                if run.rank == 0:
                    print(f"step={run.progress.global_step} epoch={epoch} loss={loss.item():.4f} "
                          f"best={between.best:.4f}", flush=True)
    if args.init_first:  # the script's own group is the script's to leave: open_run left it usable
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
