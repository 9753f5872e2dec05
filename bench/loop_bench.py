"""What does a plain training loop pay for recovery when nothing fails? The same loop (a 3-layer
MLP of width 2048 with AdamW, about 98 MB of state, batch 256, one process, one thread:
OMP_NUM_THREADS=1) timed in one run, each way as its user would write it (issue 55's table):

- bare: a shuffled `DataLoader`, no checkpoint (the reference);
- `torch.save` of the model's and optimizer's state dicts every N steps;
- torch's own `dcp.async_save` every N steps (the previous one awaited before the next);
- the loop reading `recovery.KeyedData` without recovery (the data's share, shown apart);
- `trainer.recovery` with `checkpoint_mode="async"` and with the default mode (`auto`: the
  mode it chose is printed), both reading `KeyedData`, a save every N steps.

Each figure is the loop's wall time ÷ the bare loop's, medians of `--repeat` rounds taken in
turn, so a load that changes during the run weighs on every row alike. Timed from the first
batch to the loop's end, the last save drained (recovery's `with` block left: its final drain
and the export it writes at the end). The async rows also print how steps with a save in
flight (the two after each save) compare with the quiet ones, and the CPU seconds of the
loop's thread against every other thread (`/proc/self/task/*/stat`): background work must run
beside the loop, not on it.

    python bench/loop_bench.py                 # the issue's size: 60 steps, a save every 10
    python bench/loop_bench.py --quick         # width 512, 20 steps, a save every 5: seconds
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: the loop on one core

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer import recovery  # noqa: E402
from trainer.checkpoint.checkpointer import effective_mode  # noqa: E402

warnings.filterwarnings("ignore")
FEATURES = 64
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Shape:
    width: int
    steps: int
    every: int
    batch: int = 256


class Samples(torch.utils.data.Dataset):
    """A map-style dataset of fixed random samples (what both readers fetch)."""

    def __init__(self, count: int, classes: int):
        generator = torch.Generator().manual_seed(1)
        self.inputs = torch.randn(count, FEATURES, generator=generator)
        self.labels = torch.randint(0, classes, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.inputs[index], self.labels[index]


def build(shape: Shape):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, shape.width), nn.ReLU(), nn.Linear(shape.width, shape.width), nn.ReLU(),
                          nn.Linear(shape.width, shape.width))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train(model, optimizer, batch) -> torch.Tensor:
    inputs, labels = batch
    loss = nn.functional.cross_entropy(model(inputs), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def thread_cpu() -> dict[int, float]:
    """CPU seconds of every live thread of this process, by thread id."""
    seconds = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return seconds


@dataclass
class Timing:
    wall_s: float = 0.0
    steps: list[float] = field(default_factory=list)
    loop_cpu_s: float = 0.0
    """The loop's own thread."""
    beside_cpu_s: float = 0.0
    """Every other thread of the process (ended ones included: process total minus the loop's)."""
    save_calls: list[tuple[float, float]] = field(default_factory=list)
    """(wall s, the loop's thread CPU s) of each call that saved: `save()`, or `run.step()` on
    a step the cadence picked (its plain steps' share in `plain_calls`)."""
    plain_calls: list[tuple[float, float]] = field(default_factory=list)


class Clock:
    """Times a loop from its first batch: each step's wall time, and CPU by thread."""

    def __init__(self):
        self.timing = Timing()
        self.loop_thread = threading.get_native_id()

    def start(self) -> None:
        self.started = self.last = time.perf_counter()
        self.process_cpu, self.loop_cpu = time.process_time(), thread_cpu().get(self.loop_thread, 0.0)

    def stepped(self) -> None:
        now = time.perf_counter()
        self.timing.steps.append(now - self.last)
        self.last = now

    def stop(self) -> Timing:
        self.timing.wall_s = time.perf_counter() - self.started
        self.timing.loop_cpu_s = thread_cpu().get(self.loop_thread, 0.0) - self.loop_cpu
        self.timing.beside_cpu_s = time.process_time() - self.process_cpu - self.timing.loop_cpu_s
        return self.timing


def loader(dataset, shape: Shape):
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(dataset, batch_size=shape.batch, shuffle=True, generator=generator)


def called(calls: list, act) -> None:
    """`act()`, its wall and the loop's thread CPU seconds appended to `calls`."""
    wall, cpu = time.perf_counter(), time.thread_time()
    act()
    calls.append((time.perf_counter() - wall, time.thread_time() - cpu))


def bare(shape: Shape, dataset, base: Path, save=None) -> Timing:
    """The plain loop over a shuffled DataLoader; `save(step, model, optimizer)` on cadence and
    `save(None, ...)` at the end (to drain what is in flight)."""
    model, optimizer = build(shape)
    clock = Clock()
    clock.start()
    for step, batch in enumerate(loader(dataset, shape), start=1):
        train(model, optimizer, batch)
        if save is not None and step % shape.every == 0:
            called(clock.timing.save_calls, lambda: save(step, model, optimizer))
        clock.stepped()
    if save is not None:
        save(None, model, optimizer)
    return clock.stop()


def torch_saves(base: Path):
    def save(step, model, optimizer) -> None:
        if step is not None:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, base / "torch-save.pt")
    return save


def dcp_async_saves(base: Path):
    """`dcp.async_save` as its documentation shows it: the previous save awaited before the next."""
    import torch.distributed.checkpoint as dcp

    pending = []

    def save(step, model, optimizer) -> None:
        if pending:
            pending.pop().result()
        if step is not None:
            folder = base / "dcp" / f"step-{step}"
            pending.append(dcp.async_save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                                          checkpoint_id=folder, no_dist=True))
    return save


def keyed_only(shape: Shape, dataset, base: Path) -> Timing:
    """The plain loop reading the trainer's keyed order, without recovery: the data's share."""
    model, optimizer = build(shape)
    data = recovery.KeyedData(dataset, batch_size=shape.batch)
    clock = Clock()
    clock.start()
    for fetched in data.shares(0, 0):
        train(model, optimizer, fetched.batch)
        clock.stepped()
    return clock.stop()


def with_recovery(mode: str | None):
    def measure(shape: Shape, dataset, base: Path) -> Timing:
        model, optimizer = build(shape)
        folder = base / f"run-{mode or 'default'}"
        shutil.rmtree(folder, ignore_errors=True)
        options = {} if mode is None else {"checkpoint_mode": mode}
        clock = Clock()
        with recovery.open_run(folder, recover=recovery.CadenceConfig(every_steps=shape.every), **options) as run:
            run.restore(model, optimizer, data=recovery.KeyedData(dataset, batch_size=shape.batch))
            clock.start()
            for _ in run.epochs(1):
                for batch in run.batches():
                    loss = train(model, optimizer, batch)
                    due = (run.progress.global_step + 1) % shape.every == 0
                    called(clock.timing.save_calls if due else clock.timing.plain_calls, lambda: run.step(loss))
                    clock.stepped()
        timing = clock.stop()
        shutil.rmtree(folder, ignore_errors=True)
        return timing
    return measure


def in_flight_ratio(timing: Timing, every: int) -> float | None:
    """Median of the two steps after each save (its write and commit in flight) ÷ median of the
    steps in the second half of each interval (nothing in flight: a 98 MB save commits within
    a step or two). None without a save."""
    after = [t for index, t in enumerate(timing.steps) if index % every in (0, 1) and index >= every]
    quiet = [t for index, t in enumerate(timing.steps) if index % every >= every // 2 + 1]
    if not after or not quiet:
        return None
    return statistics.median(after) / statistics.median(quiet)


def median_ms(calls: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(wall ms, CPU ms): the medians of `calls`; None without any."""
    if not calls:
        return None
    return statistics.median(c[0] for c in calls) * 1000, statistics.median(c[1] for c in calls) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="a save every N steps")
    parser.add_argument("--repeat", type=int, default=2, help="rounds (medians)")
    parser.add_argument("--quick", action="store_true", help="width 512, 20 steps, a save every 5, one round")
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary folder under /tmp)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    shape = Shape(512, 20, 5) if args.quick else Shape(args.width, args.steps, args.every)
    repeat = 1 if args.quick else args.repeat
    torch.set_num_threads(1)
    dataset = Samples(shape.steps * shape.batch, shape.width)
    model, _ = build(shape)
    state_mb = sum(p.numel() for p in model.parameters()) * 12 / (1 << 20)  # weights and AdamW's two moments
    default_mode = effective_mode(recovery.RunConfig.checkpoint_mode, torch.device("cpu"))
    rows = {"bare DataLoader, no checkpoint": lambda s, d, b: bare(s, d, b),
            f"torch.save every {shape.every}": lambda s, d, b: bare(s, d, b, torch_saves(b)),
            f"dcp.async_save every {shape.every}": lambda s, d, b: bare(s, d, b, dcp_async_saves(b)),
            "KeyedData, no recovery (the data's share)": keyed_only,
            'trainer.recovery, checkpoint_mode="async"': with_recovery("async"),
            f"trainer.recovery, the default (auto: {default_mode})": with_recovery(None)}
    base = Path(tempfile.mkdtemp(prefix="loop-bench-", dir=args.dir))
    timings: dict[str, list[Timing]] = {name: [] for name in rows}
    try:
        bare(Shape(shape.width, 3, shape.every), dataset, base)  # warm-up: allocator, kernels' first calls
        for _ in range(repeat):
            for name, measure in rows.items():
                timings[name].append(measure(shape, dataset, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    reference = statistics.median(t.wall_s for t in timings["bare DataLoader, no checkpoint"])
    keyed = statistics.median(t.wall_s for t in timings["KeyedData, no recovery (the data's share)"])
    load = os.getloadavg()[0]
    print(f"\na plain loop, {state_mb:.0f} MB of state (MLP width {shape.width}, AdamW), batch {shape.batch}, "
          f"{shape.steps} steps, one process, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, medians of "
          f"{repeat} (load average {load:.2f}); the default mode on CPU: {default_mode}\n")
    print("| the same loop with | loop s | ÷ bare | ÷ KeyedData alone | step with a save in flight ÷ quiet | "
          "loop thread CPU s | other threads CPU s | the call that saves: wall ms / loop CPU ms | run.step "
          "otherwise: loop CPU ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    result = {"state_mb": state_mb, "shape": shape.__dict__, "repeat": repeat, "load_average": load,
              "default_mode": default_mode, "rows": {}}
    for name, measured in timings.items():
        wall = statistics.median(t.wall_s for t in measured)
        ratios = [r for t in measured if (r := in_flight_ratio(t, shape.every)) is not None]
        saves = measured is not timings["KeyedData, no recovery (the data's share)"]
        in_flight = statistics.median(ratios) if ratios and saves else None
        row = {"loop_s": wall, "vs_bare": wall / reference, "vs_keyed": wall / keyed,
               "in_flight_vs_quiet": in_flight,
               "loop_cpu_s": statistics.median(t.loop_cpu_s for t in measured),
               "beside_cpu_s": statistics.median(t.beside_cpu_s for t in measured),
               "step_s": statistics.median(s for t in measured for s in t.steps),
               "save_call_ms": median_ms([call for t in measured for call in t.save_calls]),
               "plain_call_ms": median_ms([call for t in measured for call in t.plain_calls])}
        save_call, plain_call = row["save_call_ms"], row["plain_call_ms"]
        result["rows"][name] = row
        print(f"| {name} | {wall:.2f} | {row['vs_bare']:.3f} | {row['vs_keyed']:.3f} | "
              f"{'' if in_flight is None else f'{in_flight:.3f}'} | {row['loop_cpu_s']:.2f} | "
              f"{row['beside_cpu_s']:.2f} | {'' if save_call is None else '%.1f / %.1f' % save_call} | "
              f"{'' if plain_call is None else f'{plain_call[1]:.1f}'} |")
    ours = result["rows"]['trainer.recovery, checkpoint_mode="async"']
    theirs = result["rows"][f"dcp.async_save every {shape.every}"]
    result["async_vs_dcp_async"] = ours["loop_s"] / theirs["loop_s"]
    print(f"\nasync through the library ÷ the dcp.async_save loop: {result['async_vs_dcp_async']:.3f} "
          f"(goal ≤ 1; ÷ bare goal ≤ 1.05); the data alone (KeyedData ÷ bare): {keyed / reference:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
