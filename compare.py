"""python compare.py A B [--json]: prove two recovery generations hold the same training state.

Exit 0 iff every field is bit-identical, 1 if any differs, 2 if an input is unreadable,
75 if interrupted (Ctrl-C, SIGTERM). The logic lives in trainer/compare.py; this file is
only the command.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from trainer.errors import EXIT_INTERRUPTED, TrainerError


def compare(argv: list[str] | None) -> int:
    from trainer.cli import OneLineParser  # imports torch: inside the interruptible part

    parser = OneLineParser(prog="python compare.py", description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="baseline generation, e.g. outputs/baseline/checkpoints/step-00000064")
    parser.add_argument("b", type=Path, help="resumed generation")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    try:
        args = parser.parse_args(argv)
        from trainer.compare import as_json, compare_states, format_table, load_generation

        results = compare_states(load_generation(args.a), load_generation(args.b))
    except TrainerError as error:
        print(f"compare: error: {error}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(as_json(args.a, args.b, results), indent=2) if args.json else format_table(results),
              flush=True)
    except BrokenPipeError:
        # `compare.py A B | head`: the reader left; the verdict is still the exit status.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if all(r.equal for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    try:
        return compare(argv)
    except KeyboardInterrupt:
        print("compare: interrupted by a signal; nothing was compared", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends like Ctrl-C: one line, 75
    sys.exit(main())
