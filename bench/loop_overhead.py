"""What does checkpointing cost the training loop? Steps per second with no recovery saves,
with sync saves and with async saves every N steps, and their ratios; and what the exactness
witness adds: its step digest against one training step, its state digest against one sync save.

    python bench/loop_overhead.py --size-mb 256 --every 5 --steps 40
    python bench/loop_overhead.py --quick

The loop is the trainer's own order of blocking points: wait_for_staging() before each step,
save() after the steps the cadence picks, finalize() at the end (counted: a run is not done
before its last generation is published). Target: async keeps >= 97% of the
checkpoint-free throughput at a cadence where sync costs >= 20%.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import facts_for, state_bytes, train_step, training_state  # noqa: E402

from trainer.checkpoint.checkpointer import build_checkpointer  # noqa: E402
from trainer.checkpoint.commit import RenameCommit  # noqa: E402
from trainer.checkpoint.section import LocalSection  # noqa: E402
from trainer.checkpoint.writer import WriterConfig  # noqa: E402
from trainer.run.checksum import parameter_checksum, state_digests  # noqa: E402
from trainer.run.witness import step_digest  # noqa: E402

warnings.filterwarnings("ignore")


def run(mode: str, size_mb: float, steps: int, every: int, keep: int, base: Path, device: torch.device,
        config: WriterConfig) -> dict:
    state, workload = training_state(size_mb, device)
    store = LocalSection(base / mode / "checkpoints")
    checkpointer = None if mode == "none" else build_checkpointer(mode, RenameCommit(store), "bench", device, config=config)
    blocked = 0.0
    train_step(state, workload, device)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        if checkpointer is not None:
            blocked += checkpointer.wait_for_staging()
        train_step(state, workload, device)
        if checkpointer is not None and step % every == 0:
            saved_at = time.perf_counter()
            checkpointer.save(state.state_dict(), facts_for(step))
            blocked += time.perf_counter() - saved_at
            for name in store.names()[:-keep]:  # keep the disk use bounded, like retention
                shutil.rmtree(store.path(name))
    if checkpointer is not None:
        checkpointer.finalize()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    shutil.rmtree(base / mode, ignore_errors=True)
    return {"steps_per_s": steps / elapsed, "wall_s": elapsed, "blocked_s": blocked,
            "saves": 0 if checkpointer is None else steps // every, "state_mb": state_bytes(state) / (1 << 20)}


def timed(action, repeats: int, device: torch.device) -> float:
    """Median seconds of `action()` over `repeats` calls (on CUDA, until the device is done)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def witness_costs(size_mb: float, repeats: int, base: Path, device: torch.device, config: WriterConfig) -> dict:
    """The witness's two costs, each beside what it rides on, in the same process."""
    state, workload = training_state(size_mb, device)
    store = LocalSection(base / "witness" / "checkpoints")
    checkpointer = build_checkpointer("sync", RenameCommit(store), "bench", device, config=config)
    step_s = timed(lambda: train_step(state, workload, device), repeats, device)
    parameters = list(state.model.parameters())
    digest_s = timed(lambda: step_digest(1.0, parameter_checksum(parameters, 0)), repeats, device)
    state_digest_s = timed(lambda: state_digests(state.state_dict()), repeats, device)
    saves = iter(range(1, repeats + 1))
    save_s = timed(lambda: checkpointer.save(state.state_dict(), facts_for(next(saves))), repeats, device)
    shutil.rmtree(base / "witness", ignore_errors=True)
    return {"step_s": step_s, "step_digest_s": digest_s, "state_digest_s": state_digest_s, "sync_save_s": save_s,
            "step_digest_vs_step": digest_s / step_s, "state_digest_vs_save": state_digest_s / save_s}


def step_cost(steps: int, layers: int, base: Path, device: torch.device) -> dict:
    """`run.step`'s own CPU cost per step, in one process: the library's per-step path (the
    readback of the step before, the witness's checksum kernels of this one, the agreement)
    on a model of `layers` small layers (its checksum reads at most 16 parameters a step,
    each a tiny kernel: the host's work, not the device's), no save before the last step.
    The goal: at most 1 ms, 1% of a 100 ms step (docs/library.md)."""
    from torch import nn

    from trainer import recovery

    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(8, 64, device=device)
    spent, bare = [], []
    logging.getLogger("trainer").setLevel(logging.WARNING)
    with recovery.open_run(base / "step-cost", recover=recovery.CadenceConfig(every_steps=10 * steps)) as run:
        run.restore(model, optimizer)
        for _ in range(steps):
            started = time.perf_counter()
            loss = model(inputs).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stepped = time.perf_counter()
            run.step(loss)
            spent.append(time.perf_counter() - stepped)
            bare.append(stepped - started)
    shutil.rmtree(base / "step-cost", ignore_errors=True)
    step_s = statistics.median(spent[1:])
    return {"parameters": len(list(model.parameters())), "steps": steps, "run_step_s": step_s,
            "bare_step_s": statistics.median(bare[1:]), "of_100ms_step": step_s / 0.1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="recovery save every N steps")
    parser.add_argument("--keep", type=int, default=2, help="generations kept on disk while running")
    parser.add_argument("--writer-threads", type=int, default=WriterConfig().threads)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--modes", nargs="+", default=["none", "sync", "async"], choices=("none", "sync", "async"))
    parser.add_argument("--step-cost-steps", type=int, default=400, help="steps of the `run.step` cost")
    parser.add_argument("--quick", action="store_true", help="64 MB, 30 steps, every 3")
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary folder under /tmp)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.steps, args.every, args.step_cost_steps = 64, 30, 3, 60
    torch.set_num_threads(1)
    device = torch.device(args.device)
    base = Path(tempfile.mkdtemp(prefix="loop-overhead-", dir=args.dir))
    try:
        results = {mode: run(mode, args.size_mb, args.steps, args.every, args.keep, base, device,
                          WriterConfig(threads=args.writer_threads))
                   for mode in args.modes}
        witness = witness_costs(args.size_mb, 5, base, device, WriterConfig(threads=args.writer_threads))
        step = step_cost(args.step_cost_steps, 32, base, device)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    reference = results.get("none", {}).get("steps_per_s")
    state_mb = next(iter(results.values()))["state_mb"]
    print(f"state {state_mb:.0f} MB on {device}, {args.steps} steps, recovery save every {args.every} steps, "
          f"{args.writer_threads} writer threads, {torch.get_num_threads()} compute thread(s)\n")
    print("| mode | steps/s | vs no checkpoints | blocked s | wall s |\n|---|---|---|---|---|")
    for mode, r in results.items():
        ratio = f"{r['steps_per_s'] / reference:.3f}" if reference else "-"
        r["ratio"] = None if not reference else round(r["steps_per_s"] / reference, 4)
        print(f"| {mode} | {r['steps_per_s']:.3f} | {ratio} | {r['blocked_s']:.3f} | {r['wall_s']:.2f} |")
    print("\n| exactness witness | seconds (median of 5) | vs |\n|---|---|---|")
    print(f"| step digest, every step | {witness['step_digest_s']:.5f} | {witness['step_digest_vs_step']:.3f} "
          f"of one training step ({witness['step_s']:.4f} s) |")
    print(f"| state digest, every save | {witness['state_digest_s']:.4f} | {witness['state_digest_vs_save']:.3f} "
          f"of one sync save ({witness['sync_save_s']:.4f} s) |")
    print(f"\n`run.step`'s own cost: {step['run_step_s'] * 1e6:.0f} µs a step (median of {step['steps'] - 1}, "
          f"{step['parameters']} parameters), {step['of_100ms_step']:.2%} of a 100 ms step "
          f"(the bare step here: {step['bare_step_s'] * 1e6:.0f} µs)")
    if args.json:
        args.json.write_text(json.dumps({"size_mb": args.size_mb, "steps": args.steps, "every": args.every,
                                         "device": str(device), "results": results, "witness": witness,
                                         "step_cost": step},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
