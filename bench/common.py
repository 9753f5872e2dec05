"""Shared pieces of the benchmarks: a training state of a chosen size, page-cache eviction,
medians. Benchmarks print tables of ratios; they are not tests."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import WorkloadConfig  # noqa: E402
from trainer.checkpoint.manifest import GenerationFacts  # noqa: E402
from trainer.run.state import TrainingState  # noqa: E402
from trainer.workload import build_workload  # noqa: E402

LAYERS = 4


def facts_for(step: int) -> GenerationFacts:
    """What a benchmark's generation describes (nothing a benchmark reads back)."""
    return GenerationFacts(step=step, epoch=0, position=step, fingerprint={}, allowed_drift=(), cadence={},
                           created_utc="bench")


def hidden_size_for(size_mb: float, layers: int = LAYERS) -> int:
    """Hidden width whose MLP weights plus SGD momentum take about `size_mb` (fp32): the
    MLP has `layers - 1` square hidden-to-hidden matrices, which hold nearly all of it."""
    params = size_mb * (1 << 20) / 8  # 4 bytes weight + 4 bytes momentum
    return max(64, round((params / (layers - 1)) ** 0.5 / 64) * 64)


def training_state(size_mb: float, device: torch.device, batch_size: int = 16) -> tuple[TrainingState, object]:
    """The example workload at a size, after one optimizer step (so momentum exists)."""
    config = WorkloadConfig(batch_size=batch_size, options=(("hidden_size", hidden_size_for(size_mb)),
                                                            ("layers", LAYERS), ("samples", batch_size * 8)))
    workload = build_workload(config)
    torch.manual_seed(0)
    model = workload.build_model().to(device)
    optimizer = workload.build_optimizer(model)
    scheduler = workload.build_scheduler(optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    state = TrainingState(model, optimizer, scheduler, scaler)
    train_step(state, workload, device, batch_size)
    return state, workload


def train_step(state: TrainingState, workload, device: torch.device, batch_size: int = 16) -> None:
    features = workload.workload.config.features
    inputs = torch.randn(batch_size, features, device=device)
    labels = torch.randint(0, workload.workload.config.classes, (batch_size,), device=device)
    loss = torch.nn.functional.cross_entropy(state.model(inputs), labels)
    state.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    float(loss.item())


def state_bytes(state: TrainingState) -> int:
    total = 0
    for tensor in state.model.state_dict().values():
        total += tensor.numel() * tensor.element_size()
    for per_param in state.optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def evict(directory: Path) -> None:
    """Drop a directory's (clean, fsynced) pages from the page cache so reads hit the disk."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def median(values: list[float]) -> float:
    return statistics.median(values)


def print_result(table: str, result: dict, json_path: Path | None) -> int:
    """A benchmark's end: its table on stdout, its result as JSON where `--json` asked; exit 0."""
    print(table)
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0
