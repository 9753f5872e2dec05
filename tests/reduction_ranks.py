"""Run by tests/test_reduction.py as N forked ranks (gloo on CPU): the `fixed-buckets`
reduction gives the same bits whatever DDP's own layout is.

Each rank computes the gradients of one MLP on its own inputs three times with the same
weights: the first backward runs with DDP's initial buckets, the next ones with the buckets DDP
rebuilt in the order the gradients became ready (what a resumed process and a long-running one
differ in). Once with DDP's buckets the size of the plan's (from the second step on, each is
sent as it is) and once with DDP's default 25 MB (each gradient copied into the plan's buckets,
which span DDP's). Rank 0 prints one JSON line: whether each way's three gradients are equal,
whether the two ways agree, and the same for DDP's own all-reduce.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.reduction import FixedBuckets, fixed_buckets_mean

BUCKET_BYTES = 100 << 10
"""Several buckets in this small model: the plan's and, where asked, DDP's."""


def gradients(ddp_bucket_bytes: int | None, fixed: bool) -> tuple[list[list[torch.Tensor]], list[int]]:
    """The gradients of three backwards (one list per backward), and how many of DDP's buckets
    were sent as they are and how many copied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 100),
                          nn.ReLU(), nn.Linear(100, 10))
    ddp = nn.parallel.DistributedDataParallel(model, **({"bucket_cap_mb": ddp_bucket_bytes / (1 << 20)}
                                                         if ddp_bucket_bytes else {}))
    sent = [0, 0]
    if fixed:
        state = FixedBuckets(list(model.parameters()), None, BUCKET_BYTES, BUCKET_BYTES)
        same_layout = state.same_layout

        def counted(bucket):
            index = same_layout(bucket)
            sent[index is None] += 1
            return index

        state.same_layout = counted
        ddp.register_comm_hook(state, fixed_buckets_mean)
    inputs = torch.randn(32, 64, generator=torch.Generator().manual_seed(dist.get_rank())) * 1e3
    computed = []
    for _ in range(3):
        ddp.zero_grad()
        ddp(inputs).square().mean().backward()
        computed.append([parameter.grad.clone() for parameter in model.parameters()])
    return computed, sent


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    aligned, aligned_sent = gradients(BUCKET_BYTES, fixed=True)
    spanning, spanning_sent = gradients(None, fixed=True)
    own, _ = gradients(BUCKET_BYTES, fixed=False)
    if dist.get_rank() == 0:
        print(json.dumps({"aligned_steady": all(equal(aligned[0], step) for step in aligned[1:]),
                          "spanning_steady": all(equal(spanning[0], step) for step in spanning[1:]),
                          "ways_agree": all(equal(a, b) for a, b in zip(aligned, spanning)),
                          "own_steady": equal(own[0], own[2]),
                          "aligned_sent": aligned_sent, "spanning_sent": spanning_sent}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
