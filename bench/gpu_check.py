"""The GPU check: what the recovery promises on CUDA, measured on one GPU in minutes.

Nothing here needs more than a CUDA image with torch (no store, no network, no server): run it
from a checkout, it copies back one summary and one log, and it exits 1 when a goal is missed.

    bash bench/gpu_check.sh OUTDIR              # on a GPU node: the whole plan, <= 8 minutes
    bash bench/gpu_check.sh --dry-run OUTDIR    # the same plan on the CPU at tiny sizes (the suite runs it)

The plan, in order (each part a process of its own, with its own time limit):

  compat     tests/test_compat.py (pytest, when the image has it; else the same private names
             resolved directly): the image's torch may be older than the pin
  loop       a GPT-style loop (bf16 autocast, AdamW, 1-4 GB of state, 100-300 ms steps) through
             `trainer.recovery`, against the same loop without it, in one process and in turns:
             off, on with no saves, on with async saves every `--every` steps. Goals:
             throughput >= 97 % of off for both; no host sync per step from the library
             (`torch.cuda.set_sync_debug_mode`, counted on steps without a save); the dip of
             the steps after a save reported; the GPU memory a save adds on top of training
             (the digest's temporaries) <= the largest tensor's bytes; pinned host memory <=
             2x the state
  exact      an async run interrupted at step 27 and resumed (`--checkpoint-mode auto`: async on
             CUDA) against an uninterrupted sync run, with `--amp` (bf16/fp16 autocast, the
             GradScaler's state): `compare` exits 0, every field bit for bit
  restore    R's restore from tier 0 and from the local disk (`python -m trainer`, one process,
             `--memory-dir`): the record's restore_s and where it came from
  spare      an in-place restart under torchrun --max-restarts with 2 processes sharing the
             GPU over gloo, through the warm spare (bench/restart_bench.py): R and its parts,
             and the restarted worker forked from the spare
Everything is judged only where a GPU ran it; `--dry-run` runs every part's code path on the
CPU (CUDA-only steps skipped, each with a line saying so) and checks that the plan finishes in
the time it claims.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@dataclass(frozen=True)
class Sizes:
    """One plan's sizes: the GPU's and the dry run's (tiny, on the CPU)."""

    layers: int
    width: int
    vocab: int
    sequence: int
    batch: int
    steps: int
    every: int
    rounds: int
    restore_hidden: int


GPU = Sizes(layers=16, width=1024, vocab=32768, sequence=1024, batch=24, steps=100, every=25, rounds=2,
            restore_hidden=2048)
"""About 235 M parameters: 2.8 GB of state (weights and AdamW's two moments, fp32), a step of
100-300 ms on one H100/H200 in bf16."""
DRY = Sizes(layers=2, width=64, vocab=256, sequence=32, batch=4, steps=12, every=4, rounds=1, restore_hidden=64)


@dataclass(frozen=True)
class Part:
    name: str
    limit_s: int
    """The GPU's time limit for this part; the plan claims their sum (<= 8 minutes)."""
    dry_limit_s: int
    """The same on the CPU at the dry run's sizes (the suite's machine: 2 loaded cores)."""


PLAN = (Part("compat", 45, 90), Part("loop", 210, 120), Part("exact", 60, 120), Part("restore", 45, 90),
        Part("spare", 100, 5))
CLAIM_S = sum(part.limit_s for part in PLAN)
DRY_CLAIM_S = sum(part.dry_limit_s for part in PLAN)
THROUGHPUT_GOAL = 0.97
PINNED_GOAL = 2.0  # pinned host bytes / state bytes


# ----------------------------------------------------------------------------- the driver
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where summary.json and gpu_check.log go")
    parser.add_argument("--dry-run", action="store_true", help="the whole plan on the CPU at tiny sizes")
    parser.add_argument("--part", choices=[part.name for part in PLAN], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        return run_part(args.part, args.out, args.dry_run)
    return drive(args.out, args.dry_run)


def drive(out: Path, dry_run: bool) -> int:
    log_path = out / "gpu_check.log"
    claim = DRY_CLAIM_S if dry_run else CLAIM_S
    began = time.monotonic()
    with open(log_path, "w") as log:
        def say(line: str) -> None:
            stamped = f"[{time.monotonic() - began:6.1f}s] {line}"
            print(stamped, flush=True)
            log.write(stamped + "\n")
            log.flush()

        cuda = has_cuda()
        if not cuda and not dry_run:
            say("no CUDA device is visible to this python: nothing to check (--dry-run runs the plan on the CPU)")
            write_json(out / "summary.json", {"cuda": False, "ok": False, "reason": "no CUDA device visible"})
            return 69
        say(f"gpu_check{' --dry-run' if dry_run else ''}: {len(PLAN)} parts, claimed <= {claim} s "
            f"({'the CPU, tiny sizes' if dry_run else 'one GPU'})")
        summary: dict = {"cuda": cuda, "dry_run": dry_run, "claimed_s": claim, "parts": {}}
        for part in PLAN:
            limit = part.dry_limit_s if dry_run else part.limit_s
            say(f"== {part.name} (limit {limit} s)")
            started = time.monotonic()
            argv = [PYTHON, str(Path(__file__).resolve()), str(out), "--part", part.name] + (["--dry-run"] if dry_run else [])
            try:
                done = subprocess.run(argv, cwd=REPO, env=part_environment(), stdout=log, stderr=subprocess.STDOUT,
                                      timeout=limit)
                code = done.returncode
            except subprocess.TimeoutExpired:
                code = None
            seconds = round(time.monotonic() - started, 1)
            result_path = out / f"{part.name}.json"
            result = json.loads(result_path.read_text()) if result_path.exists() else {}
            result.update({"exit": code, "seconds": seconds})
            if code is None:
                result.setdefault("missed", []).append(f"did not finish within {limit} s")
            elif code != 0:
                result.setdefault("missed", []).append(f"exited {code} (see gpu_check.log)")
            summary["parts"][part.name] = result
            for line in result.get("skipped", []):
                say(f"   skipped: {line}")
            for line in result.get("figures", []):
                say(f"   {line}")
            for line in result.get("missed", []):
                say(f"   MISSED: {line}")
            say(f"   {part.name}: {'ok' if not result.get('missed') else 'missed'} in {seconds} s")
        total = round(time.monotonic() - began, 1)
        summary["seconds"] = total
        if total > claim:
            summary["over_claim"] = f"the plan took {total} s, claimed {claim} s"
            say(f"MISSED: {summary['over_claim']}")
        summary["ok"] = not summary.get("over_claim") and all(not p.get("missed") for p in summary["parts"].values())
        write_json(out / "summary.json", summary)
        say(f"gpu_check: {'every goal met' if summary['ok'] else 'a goal was missed'} in {total} s "
            f"(summary.json, gpu_check.log in {out})")
    return 0 if summary["ok"] else 1


def part_environment() -> dict:
    environment = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "PYTHONUNBUFFERED": "1"}
    environment.pop("CUDA_LAUNCH_BLOCKING", None)  # a blocking launch would hide every overlap measured here
    return environment


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


# ----------------------------------------------------------------------------- the parts
def run_part(name: str, out: Path, dry_run: bool) -> int:
    """One part in its own process: its result in OUT/NAME.json ({figures, skipped, missed, ...})."""
    result: dict = {"figures": [], "skipped": [], "missed": []}
    try:
        PARTS[name](out, dry_run, result)
    finally:
        write_json(out / f"{name}.json", result)
    return 0


def part_compat(out: Path, dry_run: bool, result: dict) -> None:
    import importlib.util

    import torch

    result["torch"], result["cuda"] = torch.__version__, torch.version.cuda
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name(0)
    if importlib.util.find_spec("pytest") is None:
        from trainer import compat

        moved = []
        for private in compat.PRIVATE_NAMES:
            try:
                private.resolve()
            except Exception as error:  # noqa: BLE001 - each moved name is reported, not raised
                moved.append(str(error))
        result["skipped"].append("pytest is not installed here: tests/test_compat.py's private names resolved directly")
        result["missed"] += moved
        result["figures"].append(f"torch {torch.__version__}: {len(compat.PRIVATE_NAMES) - len(moved)} of "
                                 f"{len(compat.PRIVATE_NAMES)} private names resolve")
        return
    done = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "tests/test_compat.py"], cwd=REPO, capture_output=True, text=True)
    tail = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    result["figures"].append(f"torch {torch.__version__}: tests/test_compat.py: {tail}")
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
        result["missed"].append(f"tests/test_compat.py failed: {tail}")


def part_loop(out: Path, dry_run: bool, result: dict) -> None:
    import torch

    from bench.gpu_loop import run_variant

    sizes = DRY if dry_run else GPU
    device = torch.device("cpu" if dry_run else "cuda")
    if dry_run:
        result["skipped"].append("host syncs, GPU memory and pinned memory are CUDA's: counted on a GPU only")
    runs: dict[str, list[dict]] = {"off": [], "on": [], "async": []}
    for round_ in range(sizes.rounds):
        for variant in runs:
            runs[variant].append(run_variant(variant, sizes, device, out / "runs" / f"{variant}-{round_}"))
    wall = {variant: statistics.median(run["wall_s"] for run in done) for variant, done in runs.items()}
    last = {variant: done[-1] for variant, done in runs.items()}
    result["state_gb"] = round(last["off"]["state_bytes"] / 1e9, 3)
    result["step_ms_off"] = round(last["off"]["median_step_s"] * 1e3, 2)
    result["throughput"] = {variant: round(wall["off"] / wall[variant], 4) for variant in ("on", "async")}
    result["dip_after_save"] = last["async"]["dip_after_save"]
    result["async_blocked_s"] = last["async"]["blocked_s"]
    result["figures"] += [
        f"state {result['state_gb']} GB, a step {result['step_ms_off']} ms without recovery",
        f"throughput: on, no saves {result['throughput']['on']:.3f}x off; async saves every {sizes.every} steps "
        f"{result['throughput']['async']:.3f}x off (goal >= {THROUGHPUT_GOAL})",
        f"the steps after a save: {result['dip_after_save']}x the median step; the loop blocked "
        f"{result['async_blocked_s']} s by saves (the record's blocked_s)"]
    if device.type == "cuda":
        syncs = {variant: last[variant]["syncs_per_plain_step"] for variant in runs}
        result["host_syncs_per_step"] = syncs
        result["save_gpu_extra_bytes"] = last["async"]["save_gpu_extra_bytes"]
        result["largest_tensor_bytes"] = last["async"]["largest_tensor_bytes"]
        result["pinned_bytes"] = last["async"]["pinned_bytes"]
        result["figures"] += [
            f"host syncs per step without a save: off {syncs['off']}, on {syncs['on']}, async {syncs['async']}",
            f"a save adds {result['save_gpu_extra_bytes'] / 2**20:.1f} MiB of GPU memory (largest tensor "
            f"{result['largest_tensor_bytes'] / 2**20:.1f} MiB); pinned host {result['pinned_bytes'] / 2**20:.1f} MiB"]
        if max(syncs["on"], syncs["async"]) > syncs["off"]:
            result["missed"].append(f"the library adds host syncs on a step without a save: {syncs}")
        if result["save_gpu_extra_bytes"] > result["largest_tensor_bytes"]:
            result["missed"].append("a save's digest takes more GPU memory than the largest tensor")
        if result["pinned_bytes"] > PINNED_GOAL * last["async"]["state_bytes"]:
            result["missed"].append(f"pinned host memory over {PINNED_GOAL}x the state")
        for variant, ratio in result["throughput"].items():
            if ratio < THROUGHPUT_GOAL:
                result["missed"].append(f"throughput {variant} {ratio:.3f}x off < {THROUGHPUT_GOAL}")
    else:
        result["skipped"].append("throughput goals are judged on a GPU only (the dry run's steps are microseconds)")


def part_exact(out: Path, dry_run: bool, result: dict) -> None:
    """The example workload on the device: async interrupted and resumed equals sync uninterrupted."""
    import shutil

    work = out / "runs" / "exact"
    shutil.rmtree(work, ignore_errors=True)
    device = ["--device", "cpu" if dry_run else "cuda", "--amp"]
    trainer(["--output", str(work / "sync"), "--checkpoint-mode", "sync", *device], 0)
    trainer(["--output", str(work / "async"), "--checkpoint-mode", "async", "--interrupt-at-step", "27", *device], 75)
    trainer(["--output", str(work / "async"), "--checkpoint-mode", "auto", "--resume", *device], 0)
    final = "checkpoints/step-00000064"
    done = subprocess.run([PYTHON, "-m", "trainer", "compare", str(work / "sync" / final), str(work / "async" / final)],
                          cwd=REPO, capture_output=True, text=True)
    modes = [json.loads(path.read_text())["checkpoint_mode"] for path in sorted((work / "async" / "attempts").glob(
        "*/attempt.json"))]
    result["modes"], result["compare_exit"] = modes, done.returncode
    result["figures"].append(f"async interrupted at 27 and resumed ({' then '.join(modes)}) against sync, --amp: "
                             f"compare exit {done.returncode}")
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-2000:], flush=True)
        result["missed"].append("the resumed async run differs from the uninterrupted sync run")
    if not dry_run and modes[-1] != "async":
        result["missed"].append(f"--checkpoint-mode auto chose {modes[-1]} on CUDA, not async")


def part_restore(out: Path, dry_run: bool, result: dict) -> None:
    """R's restore, one process: an attempt interrupted after tier 0 and the disk both hold
    generations; its run directory resumed from tier 0, and a copy of it resumed from the disk."""
    import shutil

    sizes = DRY if dry_run else GPU
    work = out / "runs" / "restore"
    shutil.rmtree(work, ignore_errors=True)
    device = "cpu" if dry_run else "cuda"
    common = ["--device", device, "--hidden-size", str(sizes.restore_hidden), "--recover-every-steps", "4",
              "--epochs", "2"]
    memory = work / "memory"
    trainer(["--output", str(work / "a"), "--memory-dir", str(memory), "--memory-every-steps", "1",
             "--interrupt-at-step", "6", *common], 75)
    shutil.copytree(work / "a", work / "b")
    trainer(["--output", str(work / "a"), "--memory-dir", str(memory), "--memory-every-steps", "1", "--resume",
             "--interrupt-at-step", "7", *common], 75)
    trainer(["--output", str(work / "b"), "--resume", "--interrupt-at-step", "7", *common], 75)
    for name, run in (("tier0", work / "a"), ("disk", work / "b")):
        record = newest_record(run)
        restored = record.get("restored") or {}
        result[name] = {"restore_s": (record.get("costs") or {}).get("restore_s"), "tier": restored.get("tier"),
                        "step": restored.get("step"), "bytes": restored.get("bytes"),
                        "startup_s": record.get("startup_s")}
        result["figures"].append(f"restore from {name}: {result[name]['restore_s']} s, {result[name]['bytes']} bytes "
                                 f"of step {result[name]['step']} ({result[name]['tier']})")
    if result["tier0"]["tier"] != "memory":
        result["missed"].append(f"the resume with tier 0 restored from {result['tier0']['tier']}, not memory")
    if result["disk"]["tier"] != "disk":
        result["missed"].append(f"the resume without tier 0 restored from {result['disk']['tier']}, not the disk")


def part_spare(out: Path, dry_run: bool, result: dict) -> None:
    if dry_run:
        result["skipped"].append("the in-place restart on CUDA: on the CPU it is bench/restart_bench.py at its "
                                 "quick size, which the suite runs already (tests/test_bench.py)")
        return
    target = out / "restart.json"
    done = subprocess.run([PYTHON, "bench/restart_bench.py", "--kinds", "kill", "--repeat", "1", "--json", str(target),
                           "--dir", str(out / "runs" / "spare"),
                           "--trainer-args=--device=cuda --data-parallel-backend=gloo"],
                          cwd=REPO, capture_output=True, text=True)
    print(done.stdout[-6000:], done.stderr[-3000:], flush=True)
    if done.returncode != 0 or not target.exists():
        result["missed"].append(f"bench/restart_bench.py exited {done.returncode}")
        return
    measured = json.loads(target.read_text())
    result["restart"] = measured
    result["figures"].append(f"R on CUDA, 2 processes over gloo, kill -9: {json.dumps(measured)[:400]}")


PARTS = {"compat": part_compat, "loop": part_loop, "exact": part_exact, "restore": part_restore, "spare": part_spare}


def trainer(args: list[str], expected: int) -> None:
    done = subprocess.run([PYTHON, "-m", "trainer", *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != expected:
        print(done.stdout[-3000:], done.stderr[-3000:], flush=True)
        raise SystemExit(f"python -m trainer {' '.join(args)}: exit {done.returncode}, expected {expected}")


def newest_record(run: Path) -> dict:
    records = sorted((run / "attempts").glob("*/attempt.json"))
    return json.loads(records[-1].read_text())


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
