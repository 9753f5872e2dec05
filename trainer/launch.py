"""`torchrun ... -m trainer.launch script.py ARGS`: your own script under torchrun, its restarts
in place warm (docs/library.md "Restarts in place in under a second").

torchrun runs this instead of the script, with the same arguments every round. In the first
round it imports torch, the script's top-level imports (read from its syntax tree: the
modules, and each name a `from` imports, so a lazy package such as transformers loads what the
script will use; one that fails is skipped, the script raises it itself) and the library, with
every CUDA query recorded (trainer/parallel/cuda_fork.py: a fork of a process that asked can
use no GPU); the node's first worker then forks the warm spare (trainer/parallel/spare.py, the
trainer's own, with its rules: this user, this launch, the environment read at import
compared, none outliving the launch, any refusal a cold start). Then it runs the script as
`__main__` with `sys.argv` as torchrun gives it to `python script.py`. A restarted worker asks
the spare and runs the script from the top in a fork that has every import done.

`env://` and `tcp://` are keyed by the restart round before the script runs
(trainer/parallel/rendezvous.py), so a group the script or its framework creates rejoins.
Differences from `python script.py`: the script's folder is put before, not instead of, the
launch's `sys.path[0]`, and a restarted worker runs the script as the first round imported it
(a source edited between restarts is read again, its imports are not).
"""

from __future__ import annotations

import ast
import importlib
import logging
import os
import runpy
import sys

from trainer.errors import UsageError
from trainer.parallel.spare import exit_as, from_spare, run_from_spare

NO_INPUT = 66
"""sysexits' EX_NOINPUT: the script named does not exist."""
USAGE = "usage: torchrun [OPTIONS] -m trainer.launch SCRIPT [ARGS...]"
WARM = ("torch", "torch.distributed.checkpoint", "torch._dynamo", "trainer.recovery")
"""What every script that uses the library imports sooner or later (the optimizer's first step
imports dynamo), before the script's own imports."""


def top_level_imports(source: str) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names imported from it) for each absolute import at the script's top level
    (inside a top-level `try`, its `except`s, or an `if` too), in order; `__future__` left out."""
    found: list[tuple[str, tuple[str, ...]]] = []

    def visit(statements) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.extend((alias.name, ()) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
                found.append((node.module, tuple(alias.name for alias in node.names if alias.name != "*")))
            elif isinstance(node, (ast.Try, ast.If)):  # a fallback's imports too: one that fails is skipped
                visit(node.body)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(node.orelse)
    visit(ast.parse(source).body)
    return found


def warm_up(script: str) -> list[str]:
    """Import what the script will: `WARM`, then its top-level imports. The modules skipped
    (each failed: the script meets the same failure itself)."""
    skipped = []
    with open(script, "rb") as source:
        imports = top_level_imports(source.read().decode("utf-8", "replace"))
    for module in WARM:
        importlib.import_module(module)
    for module, names in imports:
        try:
            imported = importlib.import_module(module)
            for name in names:
                getattr(imported, name, None)  # a lazy package's attribute loads its module
        except BaseException:  # noqa: BLE001 - any failure at import is the script's to raise, not ours
            skipped.append(module)
    return skipped


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1].startswith("-"):
        print(f"trainer.launch: error: no script given; {USAGE}", file=sys.stderr)
        sys.exit(UsageError.exit_code)
    script = argv[1]
    if not os.path.isfile(script):
        print(f"trainer.launch: error: the script {script} does not exist; {USAGE}", file=sys.stderr)
        sys.exit(NO_INPUT)
    if (status := run_from_spare(argv, os.environ)) is not None:  # a restart the warm spare forked a worker for
        exit_as(status)
    folder = os.path.dirname(os.path.abspath(script))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # as `python script.py` finds the script's own modules
    prepare(script)
    sys.argv = list(argv[1:])
    runpy.run_path(script, run_name="__main__")


def prepare(script: str) -> None:
    """The first round's imports and the spare (the spare's own workers find them done)."""
    import torch  # noqa: F401  (before the queries are watched: they wrap torch's functions)

    from trainer.parallel.cuda_fork import SCRIPT, CudaQueries

    queries = CudaQueries().watch()
    try:
        skipped = warm_up(script)
    finally:
        queries.stop()
    from trainer.cli import collect_after_start_up, fork_warm_spare
    from trainer.parallel.launch import LaunchEnvironment
    from trainer.parallel.rendezvous import install_under_torchrun

    install_under_torchrun(os.environ)
    if from_spare(os.environ):
        return
    collect_after_start_up()
    if skipped:
        logging.getLogger("trainer").info("warm spare: not imported beforehand (they failed): %s", ", ".join(skipped))
    fork_warm_spare(LaunchEnvironment.from_environ(os.environ), queries, "plain `torchrun script.py`", SCRIPT)


if __name__ == "__main__":
    main(sys.argv)
