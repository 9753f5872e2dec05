"""What does recovery in your own loop cost against the framework's own checkpointing of the
same model? One save and one restore each, side by side (docs/library.md "Measured"):

- plain PyTorch: `run.save()` / `open_run` + `run.restore()` against `torch.save` of the
  model's, optimizer's and scheduler's state dicts / `torch.load` + `load_state_dict`;
- Accelerate: the same through `recovery.accelerated` against `accelerator.save_state` /
  `load_state`;
- Lightning: the same state through `run.restore` (what `recovery.lightning` hands over)
  against `Trainer.save_checkpoint` / loading its checkpoint into the module and optimizer;
- Hugging Face `Trainer`: a generation of HF's live state (model, optimizer, scheduler,
  TrainerState, RNGs) against HF's own checkpoint (`_save_checkpoint`: model.safetensors,
  optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json) and HF's resume loads.

Ours fsyncs every file, hashes it (BLAKE3) while writing, writes and signs nothing else than
the manifest, and records the attempt; a restore verifies every file, checks the fingerprint,
loads strictly and digests the restored state (the witness). The frameworks do none of that.

Two modes of ours: the sync save (the time `run.save()` takes), compared also with stock
`dcp.save` of the same state dicts followed by an fsync of its files (the fair durable
baseline, timed right after each of our saves, in pairs; wall and CPU seconds), and the
async save (`checkpoint_mode="async"`: the time `run.save()` blocks the loop, the write going
on in the background; the next save waits until it is published, as a cadence spaces saves).
One process for the four loops; then the plain loop on `--nproc` processes (DDP replicas)
under `torchrun --standalone`, each figure the slowest rank's.

    python bench/library_bench.py --size-mb 128
    python bench/library_bench.py --quick       # 4 MB; the two processes started without torchrun's agent
    python bench/library_bench.py --parts       # only the sync save taken apart (plain state)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer import recovery  # noqa: E402
from trainer.layout import generation_name  # noqa: E402

warnings.filterwarnings("ignore")


class Measured(Exception):
    """Ends a restore-only attempt once its restore is timed (its record says `failed`)."""


def mlp(size_mb: float) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """An MLP whose weights plus AdamW's two moments take about `size_mb`, after one step."""
    width = max(64, round((size_mb * (1 << 20) / 12 / 3) ** 0.5 / 64) * 64)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(3)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    model(torch.randn(4, width)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def timed(act) -> float:
    started = time.perf_counter()
    act()
    return time.perf_counter() - started


def cpu_seconds() -> float:
    """This process's CPU time so far, every thread's, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_split(act) -> tuple[float, float, float]:
    """(wall s, user CPU s, system CPU s) of `act()`, every thread of this process."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    wall = timed(act)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def timed_both(act) -> tuple[float, float]:
    """(wall s, CPU s) of `act()`: on a loaded machine the wall time is mostly waiting for a core."""
    cpu = cpu_seconds()
    wall = timed(act)
    return wall, cpu_seconds() - cpu


def medians(save, load, repeat: int) -> tuple[float, float]:
    """(save s, restore s), medians of `repeat` each; the first save (a warm-up) is not counted."""
    saves = [timed(save) for _ in range(repeat + 1)][1:]
    return statistics.median(saves), statistics.median(timed(load) for _ in range(repeat))


def ours(folder: Path, hand_over, repeat: int, mode: str = "sync", beside=None) -> dict:
    """Medians of our save (`save_s`, `save_cpu_s`) and restore (`restore_s`, sync only):
    `hand_over(run)` hands the objects to `run` (restoring them). The save is the time
    `run.save()` blocks the loop; with `mode` "async" the loop then trains on until the
    generation is published (not counted), as a cadence spaced saves apart: a save right after
    another waits for the one in flight, which no loop with a cadence does. `beside()`, timed
    right after each save (`beside_s`, `beside_cpu_s`): a baseline measured in pairs with ours,
    so a load that changes during the run weighs on both alike."""
    figures: dict[str, list[float]] = {"save_s": [], "save_cpu_s": [], "beside_s": [], "beside_cpu_s": []}
    with recovery.open_run(folder, max_failed_attempts=0, checkpoint_mode=mode) as run:
        hand_over(run)
        for _ in range(repeat + 1):
            run.step(0.0)  # a generation per step: each save is a new one
            for key, value in zip(("save_s", "save_cpu_s"), timed_both(run.save)):
                figures[key].append(value)
            published(folder / "checkpoints" / generation_name(run.progress.global_step))
            if beside is not None:
                for key, value in zip(("beside_s", "beside_cpu_s"), beside()):
                    figures[key].append(value)
    result = {key: statistics.median(values[1:]) for key, values in figures.items() if values}  # first: a warm-up
    if mode != "sync":
        return result
    restores = []
    for _ in range(repeat):
        try:
            with recovery.open_run(folder, resume="latest", max_failed_attempts=0) as run:
                started = time.perf_counter()  # open_run verified; restore checks, loads, digests (the witness)
                hand_over(run)
                raise Measured(time.perf_counter() - started)
        except Measured as measured:
            restores.append(measured.args[0] + verify_seconds(folder))
    return {**result, "restore_s": statistics.median(restores)}


def published(generation: Path, timeout_s: float = 300.0) -> None:
    """Wait until `generation` is published (its manifest renamed into place) and retention's
    deletion of an older one, which runs beside the loop, is done (it would slow what comes next)."""
    deadline = time.monotonic() + timeout_s
    while not (generation / "manifest.json").is_file() or any(generation.parent.glob(".step-*.deleting-*")):
        if time.monotonic() > deadline:
            raise SystemExit(f"library_bench: {generation} was not published within {timeout_s:.0f} s")
        time.sleep(0.005)


def fsync_paths(paths) -> None:
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def durable_dcp_save(state_dict, base: Path):
    """`save()` -> (wall s, CPU s) of stock `dcp.save` of `state_dict()` (its FileSystemWriter,
    defaults) followed by an fsync of every file it wrote and of the folder: the durable
    baseline a sync save of ours (hashed, fsynced, manifest, rename) is compared with."""
    import torch.distributed.checkpoint as dcp

    folder = base / "dcp-baseline"

    def save() -> tuple[float, float]:
        shutil.rmtree(folder, ignore_errors=True)
        return timed_both(lambda: (dcp.save(state_dict(), checkpoint_id=folder, no_dist=True),
                                   fsync_paths([*folder.iterdir(), folder])))
    return save


def both_modes(base: Path, name: str, hand_over, state_dict, repeat: int) -> dict:
    """Our sync save and restore, each save paired with the durable DCP baseline of the same
    state, and our async save."""
    sync = ours(base / f"{name}-run", hand_over, repeat, beside=durable_dcp_save(state_dict, base))
    shutil.rmtree(base / "dcp-baseline", ignore_errors=True)
    blocked = ours(base / f"{name}-async-run", hand_over, repeat, mode="async")["save_s"]
    return {"ours": (sync["save_s"], sync["restore_s"]), "ours_async_save_s": blocked,
            "dcp_durable_save_s": sync["beside_s"], "our_save_cpu_s": sync["save_cpu_s"],
            "dcp_durable_save_cpu_s": sync["beside_cpu_s"]}


def attempt_records(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((folder / "attempts").glob("*/attempt.json"))]


def verify_seconds(folder: Path) -> float:
    """What the restoring attempt spent verifying in `open_run`, before `restore`."""
    return attempt_records(folder)[-1].get("costs", {}).get("verify_s", 0.0)


def state_dicts(model, optimizer, scheduler) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}


def plain(size_mb: float, base: Path, repeat: int) -> dict:
    model, optimizer, scheduler = mlp(size_mb)
    path = base / "plain.pt"

    def torch_save():
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, path)

    def torch_load():
        stored = torch.load(path, weights_only=True)
        model.load_state_dict(stored["model"])
        optimizer.load_state_dict(stored["optimizer"])
        scheduler.load_state_dict(stored["scheduler"])
    def torch_save_durable():  # what a save that survives a power cut adds: the file's and folder's fsync
        torch_save()
        fsync_paths([path])
    return {"framework": "torch.save", "theirs": medians(torch_save, torch_load, repeat),
            "their_durable_save_s": medians(torch_save_durable, lambda: None, repeat)[0],
            **both_modes(base, "plain", lambda run: run.restore(model, optimizer, scheduler),
                         lambda: state_dicts(model, optimizer, scheduler), repeat)}


def accelerate(size_mb: float, base: Path, repeat: int) -> dict:
    from accelerate import Accelerator

    from trainer.recovery import accelerated

    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = accelerator.prepare(*mlp(size_mb))
    folder = base / "accelerate"
    theirs = medians(lambda: accelerator.save_state(folder), lambda: accelerator.load_state(folder), repeat)
    return {"framework": "accelerator.save_state", "theirs": theirs,
            **both_modes(base, "accelerate", lambda run: accelerated.load_state(accelerator, run),
                         lambda: state_dicts(model, optimizer, scheduler), repeat)}


def hugging_face(size_mb: float, base: Path, repeat: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from trainer.recovery import hf  # imports transformers: not in the torchrun workers

    width = max(64, round((size_mb * (1 << 20) / 12 / 12 / 4) ** 0.5 / 64) * 64)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=width, n_layer=4, n_head=4))
    tokens = torch.randint(0, 256, (8, 32))
    trainer = Trainer(model=model, train_dataset=[{"input_ids": row, "labels": row} for row in tokens],
                      args=TrainingArguments(output_dir=str(base / "hf"), max_steps=1, save_strategy="no",
                                             report_to=[], use_cpu=True, disable_tqdm=True,
                                             per_device_train_batch_size=8))
    trainer.train()
    checkpoint = base / "hf" / f"checkpoint-{trainer.state.global_step}"

    def hf_load():
        trainer._load_from_checkpoint(str(checkpoint))
        trainer._load_optimizer_and_scheduler(str(checkpoint))
        trainer._load_rng_state(str(checkpoint))
    theirs = medians(lambda: trainer._save_checkpoint(trainer.model, None), hf_load, repeat)

    def hand_over(run):
        state = hf.HFTrainerState(trainer.state)
        run.restore(trainer.model, hf.unwrapped(trainer.optimizer, "optimizer"),
                    hf.unwrapped(trainer.lr_scheduler, "scheduler"), extras={"hf_trainer_state": state})
        state.live = True
    return {"framework": "Trainer._save_checkpoint", "theirs": theirs,
            **both_modes(base, "hf", hand_over, lambda: state_dicts(trainer.model, trainer.optimizer,
                                                                      trainer.lr_scheduler), repeat)}


def lightning_fit(size_mb: float, base: Path, repeat: int) -> dict:
    import lightning.pytorch as pl

    from trainer.recovery import lightning

    model, optimizer, scheduler = mlp(size_mb)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return [optimizer], [scheduler]

    width = model[0].in_features
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, width)), batch_size=4)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    module = Module()
    trainer.fit(module, train_dataloaders=loader)
    path = base / "lightning.ckpt"

    def lightning_load():
        stored = torch.load(path, weights_only=False)  # Lightning's checkpoint pickles hyper-parameters
        module.load_state_dict(stored["state_dict"])
        optimizer.load_state_dict(stored["optimizer_states"][0])
        scheduler.load_state_dict(stored["lr_schedulers"][0])
    theirs = medians(lambda: trainer.save_checkpoint(path), lightning_load, repeat)
    return {"framework": "Trainer.save_checkpoint", "theirs": theirs,
            **both_modes(base, "lightning", lambda run: run.restore(module, optimizer, scheduler),
                         lambda: state_dicts(module, optimizer, scheduler), repeat)}


def plain_on_ranks(size_mb: float, base: Path, repeat: int) -> dict:
    """One process of the plain row on several processes (`--rank-worker`): a DDP replica of the
    MLP on every rank. Each figure is the slowest rank's (the loop waits for it): rank 0's
    `torch.save` (what a DDP loop does), stock `dcp.save` across the ranks followed by each
    rank's fsync of the files it wrote, and our save in both modes. Rank 0 returns the figures."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")  # open_run uses the script's group and leaves it to the script
    rank = dist.get_rank()
    model, optimizer, scheduler = mlp(size_mb)  # the same seed on every rank: replicas
    model = DistributedDataParallel(model)

    def slowest(act) -> float:
        dist.barrier()
        seconds = torch.tensor([timed(act)], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return seconds.item()

    def torch_save():
        if rank == 0:
            torch.save(state_dicts(model, optimizer, scheduler), base / "plain-ranks.pt")

    def durable_dcp_save():
        folder = base / "dcp-ranks"
        dcp.save(state_dicts(model, optimizer, scheduler), checkpoint_id=folder)
        fsync_paths([*folder.glob(f"__{rank}_*"), *([folder / ".metadata", folder] if rank == 0 else [])])

    def dcp_once() -> float:
        if rank == 0:
            shutil.rmtree(base / "dcp-ranks", ignore_errors=True)
        dist.barrier()
        return slowest(durable_dcp_save)

    def ours_on_ranks(mode: str, beside=None) -> tuple[float, float]:
        """Medians of our save and of `beside()`, timed right after each of ours (a pair)."""
        folder = base / f"plain-ranks-{mode}-run"
        saves, besides = [], []
        with recovery.open_run(folder, max_failed_attempts=0, checkpoint_mode=mode) as run:
            run.restore(model, optimizer, scheduler)
            for _ in range(repeat + 1):
                run.step(0.0)
                saves.append(slowest(run.save))
                published(folder / "checkpoints" / generation_name(run.progress.global_step))
                if beside is not None:
                    besides.append(beside())
        return statistics.median(saves[1:]), statistics.median(besides[1:]) if besides else float("nan")

    their_save = statistics.median([slowest(torch_save) for _ in range(repeat + 1)][1:])
    (sync, durable), (blocked, _) = ours_on_ranks("sync", beside=dcp_once), ours_on_ranks("async")
    mb = state_mb(base / "plain-ranks-sync-run") if rank == 0 else 0.0
    dist.barrier()
    dist.destroy_process_group()
    return {"framework": "torch.save on rank 0", "mb": round(mb, 1), "their_save_s": their_save, "our_async_save_s": blocked,
            "async_save_ratio": blocked / their_save, "our_save_s": sync, "dcp_durable_save_s": durable,
            "sync_vs_dcp_durable": sync / durable}


def sync_parts(size_mb: float, base: Path, repeat: int) -> dict:
    """The sync save of the plain state taken apart (`--parts`): in each round, our save
    (`run.save()`) and then each part alone, one after the other, so a load that changes
    during the run weighs on all alike; a warm-up round first, then medians of `repeat`
    rounds of (wall s, user CPU s, system CPU s). The parts: stock `dcp.save` plus an fsync of
    its files (the baseline), our writer alone (`write_snapshot`: four files written at once,
    each hashed while written and fsynced; no manifest, no record) with its default threads
    and with one, the digest of every tensor's bytes on one thread (BLAKE3, which the manifest
    records, and sha256, which generations before it hold), and the exactness witness's
    digest of the state."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.digest import BLAKE3, SHA256, hasher

    from trainer.checkpoint.snapshot import write_snapshot
    from trainer.config import WriterConfig
    from trainer.run.checksum import one_process_digest

    model, optimizer, scheduler = mlp(size_mb)

    def state() -> dict:
        return state_dicts(model, optimizer, scheduler)

    def tensors(value) -> list[torch.Tensor]:
        if isinstance(value, dict):
            return [tensor for item in value.values() for tensor in tensors(item)]
        return [value] if isinstance(value, torch.Tensor) else []

    def every_byte(algorithm: str):
        def digest(folder: Path) -> None:
            for tensor in tensors(state()):
                hasher(algorithm).update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        return digest

    def writer(threads: int):
        def write(folder: Path) -> None:
            folder.mkdir()
            write_snapshot(state(), folder, WriterConfig(threads=threads), alone=True)
            fsync_paths([folder])
        return write

    def durable_dcp(folder: Path) -> None:
        dcp.save(state(), checkpoint_id=folder, no_dist=True)
        fsync_paths([*folder.iterdir(), folder])

    parts = {"dcp.save + fsync": durable_dcp, f"our writer alone ({WriterConfig().threads} threads)":
             writer(WriterConfig().threads), "our writer alone (1 thread)": writer(1),
             "blake3 of every byte (1 thread)": every_byte(BLAKE3),
             "sha256 of every byte (1 thread)": every_byte(SHA256),
             "witness digest": lambda folder: one_process_digest(state())}
    figures: dict[str, list[tuple[float, float, float]]] = {"our sync save (run.save)": [], **{name: [] for name in parts}}
    folder = base / "parts-run"
    with recovery.open_run(folder, max_failed_attempts=0, checkpoint_mode="sync") as run:
        run.restore(model, optimizer, scheduler)
        for _ in range(repeat + 1):
            run.step(0.0)
            figures["our sync save (run.save)"].append(timed_split(run.save))
            published(folder / "checkpoints" / generation_name(run.progress.global_step))
            for index, (name, part) in enumerate(parts.items()):
                target = base / f"part-{index}"
                figures[name].append(timed_split(lambda: part(target)))
                shutil.rmtree(target, ignore_errors=True)
    return {name: [statistics.median(values[1:]) for values in zip(*rounds)] for name, rounds in figures.items()}


def print_parts(parts: dict, size_mb: float) -> None:
    wall, user, system = parts["dcp.save + fsync"]
    print(f"\nthe sync save taken apart, about {size_mb:g} MB of state, one process (load average "
          f"{os.getloadavg()[0]:.1f}); seconds, medians; ratios against dcp.save + fsync\n")
    print("| part | wall s | user CPU s | system CPU s | wall / dcp+fsync | CPU / dcp+fsync |")
    print("|---|---|---|---|---|---|")
    for name, (part_wall, part_user, part_system) in parts.items():
        print(f"| {name} | {part_wall:.3f} | {part_user:.3f} | {part_system:.3f} | {part_wall / wall:.2f} | "
              f"{(part_user + part_system) / (user + system):.2f} |")


def under_torchrun(args, size_mb: float, repeat: int, base: Path) -> dict:
    """The plain row on `args.nproc` processes: this script's workers under `torchrun
    --standalone`; with `--quick` (the suite's) started as torchrun starts them (the same
    environment) but without its agent, a process and an import of torch fewer."""
    import socket
    import subprocess

    out, nproc = base / "ranks.json", args.nproc
    worker = [__file__, "--rank-worker", "--size-mb", str(size_mb), "--repeat", str(repeat), "--dir", str(base),
              "--json", str(out)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}  # the ranks share the cores (torchrun's default)
    if not args.quick:
        commands = [([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(nproc),
                      *worker], environment)]
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        commands = [([sys.executable, *worker], {**environment, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                 "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
                    for rank in range(nproc)]
    logs = [base / f"ranks-{index}.log" for index in range(len(commands))]
    launched = []
    for (command, env), log in zip(commands, logs):
        with log.open("w") as errors:
            launched.append(subprocess.Popen(command, env=env, stdout=errors, stderr=subprocess.STDOUT))
    while any(process.poll() is None for process in launched) and not any(process.returncode for process in launched):
        time.sleep(0.1)
    for process, log in zip(launched, logs):
        if process.returncode:  # the others would wait for it in a collective
            for other in launched:
                if other.poll() is None:
                    other.kill()
                    other.wait()
            raise SystemExit(f"library_bench: the {nproc}-process run failed (exit {process.returncode}):\n"
                             f"{log.read_text()[-3000:]}")
    return {**json.loads(out.read_text()), "nproc": nproc}


def state_mb(folder: Path) -> float:
    """The newest generation's shards, in MB."""
    newest = sorted((folder / "checkpoints").glob("step-*"))[-1]
    return sum(path.stat().st_size for path in newest.glob("*.distcp")) / (1 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=256, help="model plus optimizer state, about")
    parser.add_argument("--repeat", type=int, default=3, help="saves and restores measured (medians)")
    parser.add_argument("--quick", action="store_true", help="4 MB, one of each: about 20 s")
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary folder under /tmp)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--nproc", type=int, default=2,
                        help="processes of the plain row under torchrun, after the one-process rows (1: none)")
    parser.add_argument("--parts", action="store_true",
                        help="only the sync save of the plain state taken apart, against dcp.save + fsync")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)  # one of --nproc's processes
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    size_mb, repeat = (4, 1) if args.quick else (args.size_mb, args.repeat)
    if args.rank_worker:
        recovery.seed_everything(0, threads=1)
        figures = plain_on_ranks(size_mb, args.dir, repeat)
        if os.environ.get("RANK") == "0":
            args.json.write_text(json.dumps(figures) + "\n")
        return
    recovery.seed_everything(0, threads=torch.get_num_threads())
    base = Path(tempfile.mkdtemp(prefix="library-bench-", dir=args.dir))
    if args.parts:
        try:
            parts = sync_parts(size_mb, base, repeat)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print_parts(parts, size_mb)
        if args.json:
            args.json.write_text(json.dumps({"size_mb": size_mb, "load_average": os.getloadavg()[0],
                                             "parts": parts}, indent=2) + "\n")
        return
    try:
        rows = {name: measure(size_mb, base, repeat) for name, measure in
                (("plain", plain), ("accelerate", accelerate), ("hf", hugging_face), ("lightning", lightning_fit))}
        for name, row in rows.items():
            row["mb"] = round(state_mb(base / f"{name}-run"), 1)
        ranks = under_torchrun(args, size_mb, repeat, base) if args.nproc > 1 else None
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\nrecovery in your own loop vs the framework's own checkpoint, about {size_mb:g} MB of state, one "
          f"process (load average {os.getloadavg()[0]:.1f})\n")
    print("| loop | theirs | MB | their save s | our async save blocks s | async ratio | our sync save s | "
          "sync ratio | dcp.save + fsync s | sync / dcp+fsync | (CPU s) | their restore s | our restore s | "
          "restore ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    result = {"size_mb": size_mb, "load_average": os.getloadavg()[0], "rows": {}}
    for name, row in rows.items():
        (their_save, their_load), (our_save, our_load) = row["theirs"], row["ours"]
        blocked, durable = row["ours_async_save_s"], row["dcp_durable_save_s"]
        figures = {"framework": row["framework"], "mb": row["mb"], "their_save_s": their_save, "our_save_s": our_save,
                   "save_ratio": our_save / their_save, "our_async_save_s": blocked,
                   "async_save_ratio": blocked / their_save, "dcp_durable_save_s": durable,
                   "sync_vs_dcp_durable": our_save / durable, "their_restore_s": their_load,
                   "our_restore_s": our_load, "restore_ratio": our_load / their_load,
                   "our_save_cpu_s": row["our_save_cpu_s"], "dcp_durable_save_cpu_s": row["dcp_durable_save_cpu_s"],
                   "sync_cpu_vs_dcp_durable": row["our_save_cpu_s"] / row["dcp_durable_save_cpu_s"]}
        if "their_durable_save_s" in row:
            figures["their_durable_save_s"] = row["their_durable_save_s"]
        result["rows"][name] = figures
        print(f"| {name} | {row['framework']} | {row['mb']} | {their_save:.3f} | {blocked:.3f} | "
              f"{figures['async_save_ratio']:.2f} | {our_save:.3f} | {figures['save_ratio']:.2f} | {durable:.3f} | "
              f"{figures['sync_vs_dcp_durable']:.2f} | {row['our_save_cpu_s']:.3f} / {row['dcp_durable_save_cpu_s']:.3f}"
              f" = {figures['sync_cpu_vs_dcp_durable']:.2f} | {their_load:.3f} | {our_load:.3f} | "
              f"{figures['restore_ratio']:.2f} |")
    durable = result["rows"]["plain"]["their_durable_save_s"]
    print(f"\ntorch.save with an fsync of its file (durable, as every save of ours is): {durable:.3f} s; "
          f"our sync save / that = {result['rows']['plain']['our_save_s'] / durable:.2f}")
    if ranks is not None:
        result["ranks"] = ranks
        print(f"\nthe plain row on {ranks['nproc']} processes under torchrun (DDP replicas; each figure the slowest "
              f"rank's; load average {os.getloadavg()[0]:.1f})\n")
        print("| processes | theirs | MB | their save s | our async save blocks s | async ratio | our sync save s | "
              "dcp.save + fsync s | sync / dcp+fsync |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {ranks['nproc']} | {ranks['framework']} | {ranks['mb']} | {ranks['their_save_s']:.3f} | "
              f"{ranks['our_async_save_s']:.3f} | {ranks['async_save_ratio']:.2f} | {ranks['our_save_s']:.3f} | "
              f"{ranks['dcp_durable_save_s']:.3f} | {ranks['sync_vs_dcp_durable']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
