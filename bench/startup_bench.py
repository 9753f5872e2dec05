"""What starting costs beyond `import torch` (docs/development.md, "Installing, and what
starting costs"): `from trainer import recovery`, and a resume from exec to its
"restored step-" line, each against `python -c "import torch"` measured in the same round.
Checkouts alternate round by round (each resumes a run of its own: the fingerprint holds the
trainer's source); medians of the rounds, wall and CPU (the CPU is the process's own, to its
end or, for the resume, to the line: on a loaded machine it is the steadier figure).
Each checkout's bytecode is compiled before the rounds (its `__pycache__`, as `pip install`
writes an installed package's): with PYTHONDONTWRITEBYTECODE=1 and no `__pycache__`, every
start compiles the trainer's modules again (0.2 s CPU more for `from trainer import recovery`
on the same machine), which no installed copy does.

    python bench/startup_bench.py --rounds 3                 # this checkout
    python bench/startup_bench.py --rounds 3 . /path/to/main # before / after
    python bench/startup_bench.py --quick --json result.json # one round (the suite's run: tests/test_bench.py)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESUME = """
import logging, os, runpy, sys, time
class AtRestored(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("restored step-"):
            print(f"restored-cpu {time.process_time()}", flush=True)  # the process's own CPU, exec to here
            os._exit(0)
logging.getLogger("trainer").addHandler(AtRestored())
sys.argv = ["trainer", "--output", sys.argv[1], "--resume"]
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
"""
"""`python -m trainer --output RUN --resume` until its "restored step-" line, which ends it."""
CASES = (("import torch", ("-c", "import torch"), None),
         ("from trainer import recovery", ("-c", "from trainer import recovery"), None),
         ("resume to 'restored step-'", ("-c", RESUME, "RUN"), "restored-cpu "))


def environment(repo: Path) -> dict:
    """The checkout on the path, and its bytecode written and read (whatever the caller's
    PYTHONDONTWRITEBYTECODE says)."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": str(repo),
            "PYTHONUNBUFFERED": "1"}


def timed(argv: list[str], repo: Path, cwd: Path, until: str | None) -> tuple[float, float]:
    """Wall and CPU seconds of `argv` to its end, or to its first line starting with `until`."""
    env = environment(repo)
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if until is None:
        process.communicate()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.perf_counter() - start, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    for line in process.stdout:
        if line.startswith(until):
            wall = time.perf_counter() - start
            process.wait()
            return wall, float(line.split()[1])
    raise SystemExit(f"{' '.join(argv)} ended (exit {process.wait()}) before a line starting {until!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="*", type=Path, default=[REPO])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round (a few seconds): proves the bench runs")
    parser.add_argument("--dir", type=Path, help="where its scratch folder goes (removed at the end)")
    parser.add_argument("--json", type=Path, help="also write the medians to this file")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    work = Path(tempfile.mkdtemp(prefix="startup-bench-", dir=args.dir))
    try:
        results = measured(args.checkouts, rounds, work, compiled=not args.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"load average {load:.1f}; medians of {rounds} rounds; bytecode compiled before them\n")
    print("| checkout | import torch (wall, CPU) | beyond it: `from trainer import recovery` (wall, CPU) | "
          "beyond it: resume to 'restored step-' (wall, CPU) |")
    print("|---|---|---|---|")
    report = {"rounds": rounds, "load_average": load, "checkouts": {}}
    for repo in args.checkouts:
        medians = {name: tuple(statistics.median(v[i] for v in results[(repo, name)]) for i in (0, 1))
                   for name, _, _ in CASES}
        torch_wall, torch_cpu = medians[CASES[0][0]]
        beyond = {name: (wall - torch_wall, cpu - torch_cpu) for name, (wall, cpu) in list(medians.items())[1:]}
        print(f"| {repo} | {torch_wall:.2f} s, {torch_cpu:.2f} s | " +
              " | ".join(f"+ {wall:.2f} s, + {cpu:.2f} s" for wall, cpu in beyond.values()) + " |")
        report["checkouts"][str(repo)] = {"import_torch": {"wall_s": torch_wall, "cpu_s": torch_cpu}, **{
            name: {"wall_beyond_torch_s": wall, "cpu_beyond_torch_s": cpu} for name, (wall, cpu) in beyond.items()}}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def measured(checkouts: list[Path], rounds: int, work: Path, compiled: bool = True) -> dict:
    """{(checkout, case): [(wall, cpu) per round]}, the checkouts alternated round by round;
    `compiled`: the library's bytecode written before the rounds (not for `--quick`, whose
    figures only show the bench runs)."""
    seeds = {}
    for index, repo in enumerate(checkouts):
        seeds[repo] = work / f"seed-{index}"
        subprocess.run([sys.executable, "-m", "trainer", "--output", str(seeds[repo]), "--interrupt-at-step", "27"],
                       cwd=repo, env=environment(repo), capture_output=True)
        if compiled:  # the library's modules compiled too
            subprocess.run([sys.executable, "-c", "from trainer import recovery"], cwd=repo, env=environment(repo),
                           capture_output=True, check=True)
    results: dict = {}
    for _ in range(rounds):
        for repo in checkouts:
            run = work / "run"
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(seeds[repo], run)
            for name, argv, until in CASES:
                command = [sys.executable, *(str(run) if part == "RUN" else part for part in argv)]
                results.setdefault((repo, name), []).append(timed(command, repo, work, until))
    return results


if __name__ == "__main__":
    main()
