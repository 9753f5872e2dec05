"""python compare.py A B [--json]: `training-recovery compare A B` (or `python -m trainer compare`)
for a checkout, with the same exit statuses: prove two recovery generations hold the same
training state. The command lives in trainer/cli.py (`run_compare`), so an installed
distribution has it too; this file is kept for the commands and tests that name it.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    # Store retries are reported as they happen, on stdout as the trainer does: stderr keeps one line.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    gc.disable()  # while torch imports (trainer/cli.py: collect_after_start_up)
    try:
        from trainer.cli import run_compare  # imports torch: inside the interruptible part
    except KeyboardInterrupt:
        print("compare: interrupted by a signal; nothing was compared", file=sys.stderr)
        return 75
    return run_compare(sys.argv[1:] if argv is None else argv, prog="python compare.py")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends like Ctrl-C: one line, 75
    sys.exit(main())
