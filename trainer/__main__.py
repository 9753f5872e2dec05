"""`python -m trainer`, and the console script `training-recovery` (pyproject.toml).

A stop request that arrives outside the training loop's own signal handling (while torch
imports, while the run starts, or after its outcome is recorded) must still end as one line
and exit 75, never a traceback or a bare death by SIGTERM. Raising KeyboardInterrupt is not
enough: library code run during start-up may swallow it (seen in CI: a SIGINT during the
imports, and the run went on to train). Nothing is written before the loop's handling takes
over, so exiting at once is safe. `trainer.errors` is tiny, so it is imported first.
"""

import functools
import os
import signal
import sys

from trainer.errors import EXIT_INTERRUPTED, UsageError
from trainer.origin import foreign_package_problem
from trainer.parallel.spare import exit_as, run_from_spare


READ_ONLY = frozenset({"list", "report", "verify", "compare"})
"""The commands that change nothing (trainer/cli.py's COMMANDS; a test keeps the two equal):
a stop there is not a training's to resume."""


def stop_outside_training(command: str | None, signum, frame) -> None:
    name = signal.Signals(signum).name
    said = (f"{command}: interrupted by {name}; nothing was changed" if command else
            f"trainer: stopped by {name} outside training (while starting or finishing); "
            f"nothing is half-written, so run it again (with --resume auto to continue)")
    os.write(2, f"{said}\n".encode())
    os._exit(EXIT_INTERRUPTED)


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in READ_ONLY else None
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, functools.partial(stop_outside_training, command))
    if problem := foreign_package_problem(sys.modules.get("trainer")):
        print(f"trainer: error: {problem}", file=sys.stderr)
        sys.exit(UsageError.exit_code)
    if (status := run_from_spare(sys.argv, os.environ)) is not None:  # a restart the warm spare forked a worker for
        exit_as(status)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script: `--workload my_module:F` as `python -m` finds it
    from trainer.cli import PROGRAM, exit_process, main as run_command  # after the handlers: importing torch takes a while

    ran = os.path.basename(sys.argv[0])  # the console script's own name, or `-m`'s trainer/__main__.py
    exit_process(run_command(program=PROGRAM if ran in ("__main__.py", "") else ran))


if __name__ == "__main__":
    main()
