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

Ours fsyncs every file, hashes it (sha256) while writing, writes and signs nothing else than
the manifest, and records the attempt; a restore verifies every file, checks the fingerprint,
loads strictly and digests the restored state (the witness). The frameworks do none of that.

Two modes of ours: the sync save (the time `run.save()` takes), compared also with stock
`dcp.save` of the same state dicts followed by an fsync of its files (the fair durable
baseline), and the async save (`checkpoint_mode="async"`: the time `run.save()` blocks the
loop, the write going on in the background; the next save waits until it is published, as a
cadence spaces saves). One process (several: under torchrun, once open_run runs there).

    python bench/library_bench.py --size-mb 256
    python bench/library_bench.py --quick
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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
from trainer.recovery import accelerated, hf  # noqa: E402

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


def medians(save, load, repeat: int) -> tuple[float, float]:
    """(save s, restore s), medians of `repeat` each; the first save (a warm-up) is not counted."""
    saves = [timed(save) for _ in range(repeat + 1)][1:]
    return statistics.median(saves), statistics.median(timed(load) for _ in range(repeat))


def ours(folder: Path, hand_over, repeat: int, mode: str = "sync") -> tuple[float, float]:
    """(save s, restore s) medians: `hand_over(run)` hands the objects to `run` (restoring them).
    The save is the time `run.save()` blocks the loop; with `mode` "async" the loop then trains
    on until the generation is published (not counted), as a cadence spaced saves apart: a save
    right after another waits for the one in flight, which no loop with a cadence does."""
    with recovery.open_run(folder, max_failed_attempts=0, checkpoint_mode=mode) as run:
        hand_over(run)
        saves = []
        for _ in range(repeat + 1):
            run.step(0.0)  # a generation per step: each save is a new one
            saves.append(timed(run.save))
            published(folder / "checkpoints" / generation_name(run.progress.global_step))
    if mode != "sync":
        return statistics.median(saves[1:]), float("nan")
    restores = []
    for _ in range(repeat):
        try:
            with recovery.open_run(folder, resume="latest", max_failed_attempts=0) as run:
                started = time.perf_counter()  # open_run verified; restore checks, loads, digests (the witness)
                hand_over(run)
                raise Measured(time.perf_counter() - started)
        except Measured as measured:
            restores.append(measured.args[0] + verify_seconds(folder))
    return statistics.median(saves[1:]), statistics.median(restores)


def published(generation: Path, timeout_s: float = 300.0) -> None:
    """Wait until `generation` is published (its manifest renamed into place)."""
    deadline = time.monotonic() + timeout_s
    while not (generation / "manifest.json").is_file():
        if time.monotonic() > deadline:
            raise SystemExit(f"library_bench: {generation} was not published within {timeout_s:.0f} s")
        time.sleep(0.005)


def durable_dcp_save(state_dict, base: Path, repeat: int) -> float:
    """Median seconds of stock `dcp.save` of `state_dict()` (its FileSystemWriter, defaults)
    followed by an fsync of every file it wrote and of the folder: the durable baseline a sync
    save of ours (hashed, fsynced, manifest, rename) is compared with. First one a warm-up."""
    import torch.distributed.checkpoint as dcp

    def save() -> float:
        folder = base / "dcp-baseline"
        shutil.rmtree(folder, ignore_errors=True)
        started = time.perf_counter()
        dcp.save(state_dict(), checkpoint_id=folder, no_dist=True)
        for path in [*folder.iterdir(), folder]:
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        return time.perf_counter() - started
    seconds = [save() for _ in range(repeat + 1)][1:]
    shutil.rmtree(base / "dcp-baseline", ignore_errors=True)
    return statistics.median(seconds)


def both_modes(base: Path, name: str, hand_over, state_dict, repeat: int) -> dict:
    """Our sync save and restore, our async save, and the durable DCP baseline of the same state."""
    sync = ours(base / f"{name}-run", hand_over, repeat)
    blocked, _ = ours(base / f"{name}-async-run", hand_over, repeat, mode="async")
    return {"ours": sync, "ours_async_save_s": blocked, "dcp_durable_save_s": durable_dcp_save(state_dict, base, repeat)}


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
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    return {"framework": "torch.save", "theirs": medians(torch_save, torch_load, repeat),
            "their_durable_save_s": medians(torch_save_durable, lambda: None, repeat)[0],
            **both_modes(base, "plain", lambda run: run.restore(model, optimizer, scheduler),
                         lambda: state_dicts(model, optimizer, scheduler), repeat)}


def accelerate(size_mb: float, base: Path, repeat: int) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = accelerator.prepare(*mlp(size_mb))
    folder = base / "accelerate"
    theirs = medians(lambda: accelerator.save_state(folder), lambda: accelerator.load_state(folder), repeat)
    return {"framework": "accelerator.save_state", "theirs": theirs,
            **both_modes(base, "accelerate", lambda run: accelerated.load_state(accelerator, run),
                         lambda: state_dicts(model, optimizer, scheduler), repeat)}


def hugging_face(size_mb: float, base: Path, repeat: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

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
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    size_mb, repeat = (4, 1) if args.quick else (args.size_mb, args.repeat)
    recovery.seed_everything(0, threads=torch.get_num_threads())
    base = Path(tempfile.mkdtemp(prefix="library-bench-", dir=args.dir))
    try:
        rows = {name: measure(size_mb, base, repeat) for name, measure in
                (("plain", plain), ("accelerate", accelerate), ("hf", hugging_face), ("lightning", lightning_fit))}
        for name, row in rows.items():
            row["mb"] = round(state_mb(base / f"{name}-run"), 1)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\nrecovery in your own loop vs the framework's own checkpoint, about {size_mb:g} MB of state, one "
          f"process (load average {os.getloadavg()[0]:.1f})\n")
    print("| loop | theirs | MB | their save s | our async save blocks s | async ratio | our sync save s | "
          "sync ratio | dcp.save + fsync s | sync / dcp+fsync | their restore s | our restore s | restore ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    result = {"size_mb": size_mb, "load_average": os.getloadavg()[0], "rows": {}}
    for name, row in rows.items():
        (their_save, their_load), (our_save, our_load) = row["theirs"], row["ours"]
        blocked, durable = row["ours_async_save_s"], row["dcp_durable_save_s"]
        figures = {"framework": row["framework"], "mb": row["mb"], "their_save_s": their_save, "our_save_s": our_save,
                   "save_ratio": our_save / their_save, "our_async_save_s": blocked,
                   "async_save_ratio": blocked / their_save, "dcp_durable_save_s": durable,
                   "sync_vs_dcp_durable": our_save / durable, "their_restore_s": their_load,
                   "our_restore_s": our_load, "restore_ratio": our_load / their_load}
        if "their_durable_save_s" in row:
            figures["their_durable_save_s"] = row["their_durable_save_s"]
        result["rows"][name] = figures
        print(f"| {name} | {row['framework']} | {row['mb']} | {their_save:.3f} | {blocked:.3f} | "
              f"{figures['async_save_ratio']:.2f} | {our_save:.3f} | {figures['save_ratio']:.2f} | {durable:.3f} | "
              f"{figures['sync_vs_dcp_durable']:.2f} | {their_load:.3f} | {our_load:.3f} | "
              f"{figures['restore_ratio']:.2f} |")
    durable = result["rows"]["plain"]["their_durable_save_s"]
    print(f"\ntorch.save with an fsync of its file (durable, as every save of ours is): {durable:.3f} s; "
          f"our sync save / that = {result['rows']['plain']['our_save_s'] / durable:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
