"""`polyaxon check` on many cases at the cost of one: this interpreter imports the pinned CLI and
what its `check` command imports on first use (about 2.3 s of CPU, nearly all of a check's
cost), then forks one child per case, which runs the CLI's own entry point (`polyaxon.cli.cli`,
what the `polyaxon` script calls) with that case's argv, its stdout and stderr in files, and
exits with the CLI's status: what a user's `polyaxon check` prints and returns (about 0.1 s of
CPU each instead of 2.3). Run by support.polyaxon.check_all with the cases' environment (the
CLI reads it at import); cases as JSON on stdin (a list of argv lists, without `polyaxon`),
results as JSON on stdout (returncode, stdout, stderr per case, in order)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def run_one(cli, argv: list[str]) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the CLI as its script runs it, `sys.exit(cli())`
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            status = 1
            try:
                cli(argv, prog_name="polyaxon")
                status = 0
            except SystemExit as stop:
                if stop.code is None or isinstance(stop.code, int):
                    status = stop.code or 0
                else:
                    print(stop.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - reported as the interpreter would, status 1
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return {"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def main() -> int:
    cases = json.load(sys.stdin)
    from polyaxon.cli import cli
    import polyaxon._polyaxonfile.check  # noqa: F401 - what `check` imports on its first call
    results = [run_one(cli, argv) for argv in cases]
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
