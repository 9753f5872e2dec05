"""What does a failure cost under torchrun, from the user's side? R, from the failure to the
first step of the restarted attempt, split into its parts.

    python bench/restart_bench.py                    # kill -9 and a frozen rank, auto bound
    python bench/restart_bench.py --quick            # kill -9 once, well under a minute
    python bench/restart_bench.py --kinds kill       # kill -9 only (a checkout that never ends a frozen rank)
    python bench/restart_bench.py --repo /tmp/old    # the same against another checkout (before/after)
    python bench/restart_bench.py --kinds freeze --step-secs 4      # 4 s steps, the failure after step 5
    python bench/restart_bench.py --kinds freeze --restarts 0       # no restart: when the launch ends
    python bench/restart_bench.py --kinds freeze --trainer-args=--checkpoint-mode=async
    python bench/restart_bench.py --scripts ddp hf --repeat 3   # users' scripts: -m trainer.launch vs plain

Users' scripts (`--scripts`, `--quick` runs ddp once): examples/own_loop_ddp.py with
`init_process_group` before open_run, examples/hf_trainer.py with `TrainingArguments` before
open_run, each at 2 processes under `torchrun --max-restarts 1` with tier 0 every step, killed
(kill -9 of rank 1) after step 10 and run to the end, then compared with an uninterrupted
launch (`exact`: compare.py exit 0); through `-m trainer.launch` (the warm spare) and plain
torchrun (cold), in the same run. A script that creates its group itself joins before the
library sees it: its join is inside imports_s.

Two processes under `torchrun --standalone --max-restarts 3` train the example workload with
tier 0 (`--memory-dir`, a save after every step) and a durable generation every 4 steps,
`--resume auto`. After step 10 the bench fails rank 1:

  kill      kill -9 (a crashed process, an OOM kill): the survivor's collective fails at once
            and it names the rank without a second reading (its pid is gone on this host)
  freeze    SIGSTOP (a hung device, a silent network, a paused machine): the survivor finds it
            by its silence (`--peer-silence-secs`, default 8 s) and ends it (same host), so
            torchrun's agent does not wait its 30 s grace for a stopped worker

and times from its own clock, reading every line as it comes:

  detection_s   the failure -> the surviving rank's one line (it names the rank)
  teardown_s    that line -> the new rank 0 process started (the agent stops the old workers
                and starts new ones; from the new record's start-up age)
  imports_s, join_s, claim_s   the new process's start-up (its record: `joined`, `startup_s`); with
                the warm spare (`spare`: yes, the default under --max-restarts) the restarted
                worker is forked with every import done, so imports_s is the thin process's
                start and the fork (`--trainer-args=--no-warm-spare`: imported afresh)
  restore_s     its restore (from which tier: `restored_from`)
  first_step_s  the rest of R, to its first step's line (build, the step)
  r_s           the failure -> that first step
  launch_ended_s  the failure -> torchrun's exit (with --restarts 0: the launch's whole end)

Fields a checkout's records do not hold (an older trainer) are None; r_s and detection_s are
the bench's own. A checkout whose restart never reaches a step reports r_s None and the lines
it printed instead.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
FAIL_AFTER = 10


def lines_of(process: subprocess.Popen) -> "queue.Queue[tuple[float, str, str]]":
    """(time, stream, line) of both streams, stamped as they arrive."""
    lines: queue.Queue = queue.Queue()
    for name, stream in (("out", process.stdout), ("err", process.stderr)):
        def read(stream=stream, name=name):
            for line in stream:
                lines.put((time.monotonic(), name, line.rstrip("\n")))
            lines.put((time.monotonic(), name, None))
        threading.Thread(target=read, daemon=True).start()
    return lines


def worker_pid(launcher: int, rank: int) -> int | None:
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                return int(child)
        except OSError:
            continue
    return None


def end_session(leader: int, timeout_s: float = 30.0) -> None:
    """SIGKILL torchrun and every process under it (its workers run in sessions of their own, so
    a process group does not reach them), then wait until none of them runs: no orphan trains on,
    or writes into a folder being removed. Zombies write nothing and do not count."""
    tree = [leader] + descendants(leader)
    tree += spare_workers(tree)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(state_of(pid) not in (None, "Z") for pid in tree):
        time.sleep(0.05)


def state_of(pid: int) -> str | None:
    """A process's state letter (R, S, Z, ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def spare_workers(fronts: list[int]) -> list[int]:
    """The workers the warm spare forked for any of `fronts` (not their descendants: the spare's
    children; each dies with its front, and is waited for all the same)."""
    wanted, found = {f"TRAINER_WARM_SPARE_FRONT={pid}".encode() for pid in fronts}, []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if wanted & set(environ.read_bytes().split(b"\0")):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found


SCRIPTS = {
    # a user's script (examples/), its options: tier 0 every step, the group created before open_run
    "ddp": ("own_loop_ddp.py", ["--epochs", "2", "--init-first"]),  # init_process_group in the script: 18 steps
    "hf": ("hf_trainer.py", ["--epochs", "5", "--arguments-first"]),  # HF's Trainer, TrainingArguments first: 15
}
"""`--scripts`: each run at 2 processes as `torchrun ... -m trainer.launch SCRIPT` (entry `launch`,
the warm spare) or `torchrun ... SCRIPT` (entry `plain`, cold), killed after step 10."""


def command_of(repo: Path, run: Path, memory: Path, restarts: int, extra: list[str], step_secs: float,
               script: str | None, entry: str) -> list[str]:
    """torchrun's command: the trainer's own (`script` None), or a user's script (SCRIPTS)."""
    launch = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "--max-restarts", str(restarts)]
    if script is not None:
        name, options = SCRIPTS[script]
        return [*launch, *(["-m", "trainer.launch"] if entry == "launch" else []), str(repo / "examples" / name),
                str(run), *options, "--memory-dir", str(memory), *extra]
    workload = ["--workload", f"{REPO}/tests/workloads/slow_steps.py:SlowSteps", "--toy-samples", "48",
                "--batch-size", "4"] if step_secs else []
    return [*launch, "-m", "trainer", "--output", str(run), "--threads", "1", "--epochs", "3", "--log-every-steps",
            "1", "--resume", "auto", "--recover-every-steps", "4", "--memory-dir", str(memory), "--memory-every-steps",
            "1", *workload, *extra]


def one_failure(repo: Path, how: str, extra: list[str], folder: Path, timeout_s: float, restarts: int = 3,
                step_secs: float = 0.0, script: str | None = None, entry: str = "launch",
                to_end: bool = False) -> dict:
    """One launch failed after step 10, timed to its restarted first step (`to_end`: and then
    on to the launch's end, for an exactness check)."""
    run, memory = folder / "run", folder / "memory"
    command = command_of(repo, run, memory, restarts, extra, step_secs, script, entry)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    process = subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**env, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1",
                                    "SLOW_STEP_SECS": str(step_secs)})
    lines, seen = lines_of(process), []
    failed_at = detected_at = first_step_at = victim = ended_at = None
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                at, stream, line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                if stream == "err":
                    process.wait()
                    ended_at = time.monotonic()
                    break
                continue
            seen.append(line)
            if failed_at is None and line.startswith(f"step={FAIL_AFTER if not step_secs else 5} "):
                victim = worker_pid(process.pid, 1)
                os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                failed_at = time.monotonic()
            elif failed_at is not None and detected_at is None and line.startswith("trainer:"):
                detected_at = at
            elif failed_at is not None and first_step_at is None and line.startswith("step=") and \
                    any(s.startswith("restored ") for s in seen):
                first_step_at = at
                if not to_end:
                    break
    finally:
        end_session(process.pid)
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()
    records = [json.loads(p.read_text()) for p in sorted((run / "attempts").glob("*/attempt.json"))]
    restarted = records[-1] if len(records) > 1 and records[-1].get("restored") else {}
    result = {"how": how, "r_s": None if first_step_at is None else round(first_step_at - failed_at, 3),
              "detection_s": None if detected_at is None else round(detected_at - failed_at, 3),
              "attempts": len(records), "restored_from": (restarted.get("restored") or {}).get("tier"),
              "warm_spare": restarted.get("warm_spare"),
              "launch_ended_s": None if ended_at is None or failed_at is None else round(ended_at - failed_at, 3),
              "restarts": restarts, "step_secs": step_secs, "trainer_args": extra,
              "script": script or "trainer", "entry": entry if script else "-m trainer",
              "status": process.returncode if ended_at is not None else None, "run": str(run)}
    joined, startup = restarted.get("joined") or {}, restarted.get("startup_s")
    if restarted and startup is not None and detected_at is not None:
        process_start = restarted["started_unix"] - startup  # wall clock, as the record keeps it
        line_unix = time.time() - (time.monotonic() - detected_at)
        result["teardown_s"] = round(process_start - line_unix, 3)
    result["imports_s"] = joined.get("at_s")
    result["join_s"] = joined.get("join_s")
    if startup is not None and joined:
        result["claim_s"] = round(startup - joined["at_s"] - joined["join_s"], 3)
    result["restore_s"] = (restarted.get("costs") or {}).get("restore_s")
    parts = [result.get(k) for k in ("detection_s", "teardown_s", "imports_s", "join_s", "claim_s", "restore_s")]
    if result["r_s"] is not None and None not in parts:  # the record is flushed later: the rest of R
        result["first_step_s"] = round(result["r_s"] - sum(parts), 3)
    if first_step_at is None and restarts:  # what it said instead: its own lines, torchrun's failures, the last few of all
        said = [line for line in seen if line.startswith("trainer:") or "exitcode" in line][-6:]
        result["lines"] = said + [line for line in seen[-8:] if line not in said]
    return result


def uninterrupted(repo: Path, script: str, folder: Path) -> Path:
    """A script's run to its end under plain torchrun, not failed: the reference of `exact`."""
    run = folder / "run"
    command = command_of(repo, run, folder / "memory", 0, [], 0.0, script, "plain")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    subprocess.run(command, cwd=repo, env={**env, "PYTHONPATH": str(repo)}, capture_output=True, timeout=600,
                   check=True)
    return run


def exact(repo: Path, reference: Path, run: Path) -> bool | None:
    """Whether a failed launch ended bit-equal to the reference (compare.py on the last
    generations, exit 0); None when it did not reach the reference's last step."""
    last = max((reference / "checkpoints").glob("step-*")).name
    if not (run / "checkpoints" / last).is_dir():
        return None
    compared = subprocess.run([sys.executable, str(repo / "compare.py"), str(reference / "checkpoints" / last),
                               str(run / "checkpoints" / last)], cwd=repo, capture_output=True,
                              env={**os.environ, "PYTHONPATH": str(repo)})
    return compared.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="kill -9 once (for CI)")
    parser.add_argument("--kinds", nargs="+", choices=("kill", "freeze"), default=["kill", "freeze"])
    parser.add_argument("--repeat", type=int, default=3, help="failures of each kind (default 3)")
    parser.add_argument("--restarts", type=int, default=3,
                        help="torchrun --max-restarts (0: no restart; the launch's end is measured instead)")
    parser.add_argument("--step-secs", type=float, default=0.0,
                        help="every step sleeps this long (tests/workloads/slow_steps.py: a big model's step)")
    parser.add_argument("--trainer-args", nargs="*", default=[], help="more trainer options, e.g. "
                        "--trainer-args=--checkpoint-mode=async")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose trainer runs (default: this one)")
    parser.add_argument("--scripts", nargs="*", choices=sorted(SCRIPTS), default=None,
                        help="users' scripts instead of the trainer (default: the trainer; --quick adds ddp)")
    parser.add_argument("--entries", nargs="+", choices=("launch", "plain"), default=["launch", "plain"],
                        help="a script's entry: `-m trainer.launch` (the warm spare) or plain torchrun (cold)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--dir", type=Path, help="where the runs go (default: a temporary folder, removed)")
    args = parser.parse_args()
    kinds = ["kill"] if args.quick else args.kinds
    trainer_args = [part for given in args.trainer_args for part in shlex.split(given)]  # "--a=1 --b=2" is two
    repeat = 1 if args.quick else args.repeat
    scripts = args.scripts if args.scripts is not None else (["ddp"] if args.quick else [])
    entries = ["launch"] if args.quick else args.entries
    results, load = [], os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="restart-bench-", dir=args.dir) as scratch:
        references = {script: uninterrupted(args.repo, script, Path(scratch) / f"reference-{script}")
                      for script in scripts}
        for number in range(repeat):
            if not args.scripts:
                for how in kinds:
                    folder = Path(scratch) / f"{how}-{number}"
                    results.append(one_failure(args.repo, how, trainer_args, folder, 120 if args.quick else 300,
                                               args.restarts, args.step_secs))
            for script, entry in ((script, entry) for script in scripts for entry in entries):
                folder = Path(scratch) / f"{script}-{entry}-{number}"
                result = one_failure(args.repo, "kill", [], folder, 300, 1, script=script, entry=entry, to_end=True)
                result["exact"] = exact(args.repo, references[script], Path(result["run"]))
                results.append(result)
    summary = {"repo": str(args.repo), "failures": results, "load": [round(x, 2) for x in load],
               "load_after": [round(x, 2) for x in os.getloadavg()]}
    for how in kinds:
        rs = sorted(r["r_s"] for r in results if r["how"] == how and r["script"] == "trainer" and r["r_s"] is not None)
        summary[f"{how}_r_median_s"] = rs[len(rs) // 2] if rs else None
    for script, entry in ((script, entry) for script in scripts for entry in entries):
        rs = sorted(r["r_s"] for r in results if (r["script"], r["entry"]) == (script, entry) and r["r_s"] is not None)
        summary[f"{script}_{entry}_r_median_s"] = rs[len(rs) // 2] if rs else None
    rows = ["| failure | R s | detection | teardown | imports | join | claim | restore | first step | from | "
            "spare | launch ended | exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cell = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
    for r in results:
        rows.append(f"| {r['how']} {r['script']} ({r['entry']}) | {cell(r['r_s'])} | {cell(r['detection_s'])} | "
                    f"{cell(r.get('teardown_s'))} | "
                    f"{cell(r.get('imports_s'))} | {cell(r.get('join_s'))} | {cell(r.get('claim_s'))} | "
                    f"{cell(r.get('restore_s'))} | {cell(r.get('first_step_s'))} | {r['restored_from'] or '-'} | "
                    f"{ {True: 'yes', False: 'no'}.get(r.get('warm_spare'), '-')} | "
                    f"{cell(r.get('launch_ended_s'))} | { {True: 'yes', False: 'NO'}.get(r.get('exact'), '-')} |"
                    + "".join(f"\n    {line}" for line in r.get("lines", [])))
    rows.append(f"\nload average (1, 5, 15 min) {summary['load']} before, {summary['load_after']} after; "
                f"{os.cpu_count()} CPUs")
    return print_result("\n".join(rows), summary, args.json)


if __name__ == "__main__":
    sys.exit(main())
