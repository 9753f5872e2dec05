"""What does a recovery save cost the loop under torchrun, sync against async, on a local
disk and in an object store? Real runs of the trainer, `torchrun --standalone --nproc_per_node
2` with FSDP2 (each rank holds and writes half of the state), read back from the attempt record.

    python bench/scale_out_bench.py                  # 2 x 256 MB per rank, 4 saves per run (minutes)
    python bench/scale_out_bench.py --quick          # a tiny model, one process, 2 saves per run (the suite's)
    python bench/scale_out_bench.py --nproc 1 --with-none   # torchrun with one process (bench/gpu_check.sh)

Four runs, each `--recover-every-steps K` over the same steps: (local, store) x (sync, async).
Without --endpoint (or AWS_ENDPOINT_URL) the store is a SeaweedFS started here, as store_bench.py
does. Per run, from rank 0's attempt record:

  blocked_s       per save, what the loop waited for: the save call, async staging waited for
                  before the next step, and store back-pressure (the record's blocked cost,
                  less the final export's)
  committed_s     per save, its start until the generation is committed (renamed on disk,
                  manifest in the store): what a crash right after would keep
  step_s          seconds per optimizer step from the first step to the end, saves included

With one process a run in an object store is tiered in both modes (published on the local
tier, uploaded in the background); with several, sync is durable when the save returns and
async uploads in the background (docs/scale-out.md). Ratios are measured in the same run of this script: async blocked / sync blocked, locally and
in the store (goals on CPU: <= 0.25 locally, <= 0.1 in the store). The first async save
allocates the staging buffers; medians over the saves are reported with the first apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from store_bench import INHERITED_AWS, s3_client, start_server  # noqa: E402

TORCHRUN = Path(sys.executable).with_name("torchrun")
BATCH = 16


def model_for(size_mb: float) -> tuple[int, int]:
    """(hidden, layers) of the example MLP whose state (fp32 weights + SGD momentum) is about
    `size_mb` in all: 8 x (layers - 1) x hidden^2 bytes."""
    layers = 5
    hidden = math.ceil(((size_mb * 1e6) / (8 * (layers - 1))) ** 0.5 / 64) * 64  # at least size_mb
    return max(hidden, 64), layers


def run_once(output: str, local_tier: Path | None, mode: str, args, hidden: int, layers: int, steps: int,
             every: int, env: dict) -> dict:
    """One trainer run; mode "none" saves only at the end (the throughput reference)."""
    nproc = args.nproc
    launcher = ([str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc)] if args.torchrun
                else [sys.executable])
    command = [*launcher, "-m", "trainer",
               "--output", output, "--checkpoint-mode", "sync" if mode == "none" else mode,
               "--hidden-size", str(hidden), "--layers", str(layers),
               "--samples", str(steps * BATCH), "--batch-size", str(BATCH), "--epochs", "1",
               "--recover-every-epochs", "0", *(() if mode == "none" else ("--recover-every-steps", str(every))),
               "--threads", "1", "--log-every-steps", "1000"]
    if nproc > 1:
        command += ["--data-parallel", "fsdp"]
    if local_tier is not None:
        command += ["--local-tier", str(local_tier)]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"scale_out_bench: the {mode} run on {output} failed ({result.returncode}):\n"
                         f"{result.stderr[-3000:]}")
    return {"wall_s": time.monotonic() - started}


def record_of(run_dir: Path) -> dict:
    [record] = [json.loads((folder / "attempt.json").read_text()) for folder in (run_dir / "attempts").iterdir()]
    return record


def figures(record: dict, saves_expected: int) -> dict:
    generations = record["generations_published"]
    if len(generations) != saves_expected:
        raise SystemExit(f"scale_out_bench: {len(generations)} generations published, expected {saves_expected}")
    exports = record.get("exports_published", [])
    blocked_total = record["costs"]["blocked_s"] - sum(entry["blocked_s"] for entry in exports)
    committed = [entry.get("durable_s", entry["save_s"]) for entry in generations]
    # From the first step to the end (the final save included): start-up and restore are not steps.
    steps = record["last_step"] - record["first_step"]
    return {"saves": len(generations), "blocked_s": blocked_total / len(generations),
            "save_call_s": [entry["blocked_s"] for entry in generations],
            "committed_s": statistics.median(committed[1:] or committed), "first_committed_s": committed[0],
            "step_s": (record["wall_s"] - record["first_step_s"]) / max(1, steps), "mode": record["checkpoint_mode"]}


def measure(args, base: Path, stack: ExitStack) -> dict:
    hidden, layers = (256, 3) if args.quick else model_for(args.size_mb * args.nproc)
    steps, every = (4, 2) if args.quick else (args.saves * args.every, args.every)
    env = {key: value for key, value in os.environ.items() if key not in INHERITED_AWS}
    env["PYTHONPATH"] = str(REPO)
    backends = ("local",) if args.local_only else ("local", "store")
    bucket = f"scale-out-bench-{uuid.uuid4().hex[:8]}"
    if "store" in backends:
        if not args.endpoint and not os.environ.get("AWS_ENDPOINT_URL"):
            start_server(stack, base)()
        elif args.endpoint:
            os.environ["AWS_ENDPOINT_URL"] = args.endpoint
        env.update({key: value for key, value in os.environ.items() if key.startswith("AWS_")})
        client = s3_client()
        client.create_bucket(Bucket=bucket)
        stack.callback(empty_bucket, client, bucket)
    results = {}
    for backend in backends:
        for mode in ("sync", "async", *(("none",) if args.with_none and backend == "local" else ())):
            name = f"{backend}-{mode}"
            if backend == "local":
                output, tier, run_dir = str(base / name), None, base / name
            else:
                output, tier, run_dir = f"s3://{bucket}/{name}", base / f"{name}-tier", base / f"{name}-tier"
            timing = run_once(output, tier, mode, args, hidden, layers, steps, every, env)
            results[name] = {**figures(record_of(run_dir), 1 if mode == "none" else steps // every), **timing}
            print(f"  {name}: blocked {results[name]['blocked_s']:.4f} s/save, committed "
                  f"{results[name]['committed_s']:.3f} s", file=sys.stderr)
    state_mb = 8 * (layers - 1) * hidden * hidden / 1e6
    ratios = {f"{backend} async/sync blocked": ratio(results, backend) for backend in backends}
    ratios["local async blocked / sync committed"] = (results["local-async"]["blocked_s"]
                                                       / results["local-sync"]["committed_s"])
    if "store" in backends:
        ratios["store async committed / local async committed"] = (results["store-async"]["committed_s"]
                                                                    / results["local-async"]["committed_s"])
    if "local-none" in results:
        ratios["throughput async / none"] = results["local-none"]["step_s"] / results["local-async"]["step_s"]
        ratios["throughput sync / none"] = results["local-none"]["step_s"] / results["local-sync"]["step_s"]
    return {"nproc": args.nproc, "launcher": "torchrun" if args.torchrun else "python -m trainer",
            "hidden": hidden, "layers": layers, "state_mb": round(state_mb, 1),
            "state_mb_per_rank": round(state_mb / args.nproc, 1), "steps": steps, "every": every, "runs": results,
            "ratios": ratios}


def ratio(results: dict, backend: str) -> float:
    return results[f"{backend}-async"]["blocked_s"] / results[f"{backend}-sync"]["blocked_s"]


def empty_bucket(client, bucket: str) -> None:
    listed = client.list_objects_v2(Bucket=bucket)
    for item in listed.get("Contents", []):
        client.delete_object(Bucket=bucket, Key=item["Key"])
    client.delete_bucket(Bucket=bucket)


def print_table(report: dict) -> None:
    print(f"{report['nproc']} processes ({report['launcher']}{', FSDP2' if report['nproc'] > 1 else ''}), state {report['state_mb']} MB ({report['state_mb_per_rank']} MB "
          f"per rank; --hidden-size {report['hidden']} --layers {report['layers']}), {report['steps']} steps, "
          f"a save every {report['every']}")
    print("| run | mode | blocked s/save | committed s (median) | first committed s | step s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for name, row in report["runs"].items():
        print(f"| {name} | {row['mode']} | {row['blocked_s']:.4f} | {row['committed_s']:.3f} | "
              f"{row['first_committed_s']:.3f} | {row['step_s']:.4f} | {row['wall_s']:.1f} |")
    goals = {"local async/sync blocked": 0.25, "store async/sync blocked": 0.1}  # on CPU; on a GPU see gpu_check.sh
    for name, value in report["ratios"].items():
        goal = goals.get(name)
        verdict = "" if goal is None else f" (goal <= {goal}: {'met' if value <= goal else 'NOT met'})"
        print(f"{name}: {value:.3f}{verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--size-mb", type=float, default=256.0, help="state per rank (MB)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    parser.add_argument("--saves", type=int, default=4, help="recovery saves per run")
    parser.add_argument("--every", type=int, default=3, help="optimizer steps between saves")
    parser.add_argument("--endpoint", help="an S3 endpoint of your own (keys from AWS_* variables)")
    parser.add_argument("--with-none", action="store_true", help="also a run without periodic saves (throughput)")
    parser.add_argument("--local-only", action="store_true", help="no object-store runs")
    parser.add_argument("--no-torchrun", dest="torchrun", action="store_false",
                        help="one process with `python -m trainer` (needs --nproc 1)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one process without torchrun, 2 saves per run (the suite's)")
    parser.add_argument("--dir", type=Path, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:  # the suite's smoke test: one process, no torchrun agent (the tests run torchrun)
        args.nproc, args.torchrun = 1, False
    if not args.torchrun and args.nproc != 1:
        parser.error("--no-torchrun runs one process: drop --nproc")
    with ExitStack() as stack:
        base = Path(tempfile.mkdtemp(prefix="scale-out-bench-", dir=args.dir))
        stack.callback(shutil.rmtree, base, ignore_errors=True)
        report = measure(args, base, stack)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
