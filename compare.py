"""python compare.py A B [--json]: prove two recovery generations hold the same training state.

A and B are generation directories or their store URLs (s3://BUCKET/RUN/checkpoints/step-…,
downloaded and verified into a temporary directory). Exit 0 iff every field is bit-identical,
1 if any differs, 2 if an input is unreadable, 65 if one holds a pickle that loading would have to
run code for (it is never unpickled), 74 if a store cannot be reached or refuses our
credentials, 75 if interrupted (Ctrl-C, SIGTERM). The logic lives in trainer/inspect/compare.py; this
file is only the command.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from trainer.errors import EXIT_INTERRUPTED, StorageFailure, TrainerError, UntrustedGeneration


def compare(argv: list[str] | None) -> int:
    gc.disable()  # while torch imports (trainer/cli.py: collect_after_start_up)
    from trainer.cli import OneLineParser  # imports torch: inside the interruptible part
    from trainer.options import location_argument

    parser = OneLineParser(prog="python compare.py", description=__doc__.splitlines()[0])
    parser.add_argument("a", type=location_argument,
                        help="baseline generation, e.g. outputs/baseline/checkpoints/step-00000064, or its store "
                             "URL s3://BUCKET/RUN/checkpoints/step-00000064")
    parser.add_argument("b", type=location_argument, help="resumed generation (a directory or a store URL)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    try:
        args = parser.parse_args(argv)
        results, ledgers = compare_inputs(args.a, args.b)
    except TrainerError as error:
        print(f"compare: error: {error}", file=sys.stderr)
        return error.exit_code if error.exit_code in (EXIT_INTERRUPTED, StorageFailure.exit_code,
                                                      UntrustedGeneration.exit_code) else 2
    try:
        from trainer.inspect.compare import as_json, format_ledgers, format_table

        print(json.dumps(as_json(args.a, args.b, results, ledgers), indent=2) if args.json
              else format_ledgers(*ledgers) + format_table(results), flush=True)
    except BrokenPipeError:
        # `compare.py A B | head`: the reader left; the verdict is still the exit status.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if all(r.equal for r in results) else 1


def compare_inputs(a: Path | str, b: Path | str) -> tuple[list, tuple[dict, dict]]:
    """Field results of two generations and their sample ledgers; one named by store URL is
    downloaded (verified while it streams) into a temporary directory that is gone afterwards."""
    from trainer.cli import collect_after_start_up
    from trainer.inspect.compare import compare_states, load_generation
    from trainer.inspect.sources import open_source

    collect_after_start_up()

    with tempfile.TemporaryDirectory(prefix="compare-") as scratch:
        first = load_generation(open_source(a).generation(Path(scratch) / "a"))
        second = load_generation(open_source(b).generation(Path(scratch) / "b"))
        return compare_states(first.state, second.state), (first.ledger, second.ledger)


def main(argv: list[str] | None = None) -> int:
    # Store retries are reported as they happen, on stdout as the trainer does: stderr keeps one line.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    try:
        return compare(argv)
    except KeyboardInterrupt:
        print("compare: interrupted by a signal; nothing was compared", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends like Ctrl-C: one line, 75
    sys.exit(main())
