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
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    try:
        seeds = {}
        for index, repo in enumerate(args.checkouts):
            seeds[repo] = work / f"seed-{index}"
            subprocess.run([sys.executable, "-m", "trainer", "--output", str(seeds[repo]), "--interrupt-at-step", "27"],
                           cwd=repo, env=environment(repo), capture_output=True)
            subprocess.run([sys.executable, "-c", "from trainer import recovery"], cwd=repo, env=environment(repo),
                           capture_output=True, check=True)  # the library's modules compiled too
        results: dict = {}
        for _ in range(args.rounds):
            for repo in args.checkouts:
                run = work / "run"
                shutil.rmtree(run, ignore_errors=True)
                shutil.copytree(seeds[repo], run)
                for name, argv, until in CASES:
                    command = [sys.executable, *(str(run) if part == "RUN" else part for part in argv)]
                    results.setdefault((repo, name), []).append(timed(command, repo, work, until))
        print(f"load average {os.getloadavg()[0]:.1f}; medians of {args.rounds} rounds; bytecode compiled before them")
        for repo in args.checkouts:
            torch_wall, torch_cpu = (statistics.median(v[i] for v in results[(repo, CASES[0][0])]) for i in (0, 1))
            print(f"{repo}: import torch {torch_wall:.2f} s wall, {torch_cpu:.2f} s CPU")
            for name, _, _ in CASES[1:]:
                wall, cpu = (statistics.median(v[i] for v in results[(repo, name)]) for i in (0, 1))
                print(f"  {name:30s} torch + {wall - torch_wall:.2f} s wall, + {cpu - torch_cpu:.2f} s CPU   "
                      f"(walls {', '.join(f'{w:.2f}' for w, _ in results[(repo, name)])})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
