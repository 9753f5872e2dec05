"""The GPU check's training loop (bench/gpu_check.py `loop`): a GPT-style model in bf16 autocast
with AdamW, trained the same way without recovery and through `trainer.recovery`, each step
timed on the device (CUDA events, no host sync) and every host sync counted.

The data is a pool of token batches already on the device: what is measured is what recovery
adds to the step, not a data pipeline.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

WARMUP = 3
"""Steps before the timed window (kernels chosen, the allocator warm, the first save's buffers)."""


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.projection = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, width)
        x = x + self.projection(attended)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.tokens = nn.Embedding(sizes.vocab, sizes.width)
        self.positions = nn.Embedding(sizes.sequence, sizes.width)
        self.blocks = nn.ModuleList(Block(sizes.width, max(1, sizes.width // 64)) for _ in range(sizes.layers))
        self.norm = nn.LayerNorm(sizes.width)
        self.head = nn.Linear(sizes.width, sizes.vocab, bias=False)

    def forward(self, tokens):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class StepClock:
    """Each step's end, on the device's own clock where there is one (events: no host sync)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class SyncCounter:
    """Host syncs per step (`torch.cuda.set_sync_debug_mode("warn")`): CUDA only."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.per_step: list[int] = []
        self._caught: list = []
        self._scope = contextlib.ExitStack()

    def __enter__(self):
        if self.cuda:
            self._caught = self._scope.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def step_done(self) -> None:
        self.per_step.append(len(self._caught))
        self._caught.clear()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self._scope.close()


def run_variant(variant: str, sizes, device: torch.device, directory: Path) -> dict:
    """`off` (no recovery), `on` (through the library, no save in the window) or `async`
    (through the library, an async save every `sizes.every` steps)."""
    from trainer import recovery

    shutil.rmtree(directory, ignore_errors=True)
    torch.manual_seed(0)
    model = GPT(sizes).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    pool = torch.randint(0, sizes.vocab, (8, sizes.batch, sizes.sequence + 1), device=device)
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())  # weights + two moments
    largest = max(p.numel() * p.element_size() for p in model.parameters())

    def train(step: int):
        batch = pool[step % len(pool)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    clock, figures = StepClock(device), {"variant": variant, "state_bytes": state_bytes,
                                         "largest_tensor_bytes": largest}
    saves_at = set()
    if variant == "off":
        for step in range(1, WARMUP + 1):
            train(step)
        began = synchronized(device)
        clock.mark()
        with SyncCounter(device) as syncs:
            for step in range(WARMUP + 1, sizes.steps + 1):
                train(step)
                clock.mark()
                syncs.step_done()
        ended = synchronized(device)
    else:
        every = sizes.every if variant == "async" else None
        cadence = recovery.CadenceConfig(every_steps=every) if every else recovery.CadenceConfig()
        with recovery.open_run(str(directory), resume=None, checkpoint_mode="async", recover=cadence,
                               device=device.type) as run:
            run.restore(model, optimizer)
            for step in range(1, WARMUP + 1):
                run.step(train(step))
            began = synchronized(device)
            clock.mark()
            with SyncCounter(device) as syncs:
                for step in range(WARMUP + 1, sizes.steps + 1):
                    loss = train(step)
                    if every and step % every == 0:
                        saves_at.add(step)
                        if "save_gpu_extra_bytes" not in figures and device.type == "cuda":
                            figures["save_gpu_extra_bytes"] = gpu_extra_of(lambda: run.step(loss))
                        else:
                            run.step(loss)
                    else:
                        run.step(loss)
                    clock.mark()
                    syncs.step_done()
            ended = synchronized(device)
            figures["pinned_bytes"] = pinned_bytes(device)
        figures["blocked_s"] = blocked_seconds(directory)
    seconds = clock.step_seconds()
    steps = list(range(WARMUP + 1, sizes.steps + 1))
    plain = [s for step, s in zip(steps, seconds) if step not in saves_at and step - 1 not in saves_at]
    after = [s for step, s in zip(steps, seconds) if step - 1 in saves_at]
    median = statistics.median(plain) if plain else statistics.median(seconds)
    figures.update({"wall_s": ended - began, "median_step_s": median,
                    "dip_after_save": round(statistics.mean(after) / median, 3) if after else None,
                    "syncs_per_plain_step": round(sum(n for step, n in zip(steps, syncs.per_step)
                                                      if step not in saves_at) / max(1, len(plain)), 3)})
    return figures


def synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def gpu_extra_of(call) -> int:
    """The GPU memory `call` allocates on top of what is live (a save's digest temporaries)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - base)


def pinned_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def blocked_seconds(directory: Path) -> float | None:
    import json

    records = sorted((directory / "attempts").glob("*/attempt.json"))
    if not records:
        return None
    return (json.loads(records[-1].read_text()).get("costs") or {}).get("blocked_s")
