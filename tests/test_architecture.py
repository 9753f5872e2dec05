"""The package's layering, read from the source: dependencies point one way
(cli → loop → recovery/export → storage), and `trainer/recovery/` never reaches up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "trainer"

LAYERS = [
    # Leaves: names, errors, configuration, test seams, private-API wrappers.
    {"trainer.errors", "trainer.layout", "trainer.config", "trainer.parallel.launch", "trainer.seams", "trainer.compat",
     "trainer.options", "trainer.storage.location", "trainer.run.interval"},
    # Storage and recovery: generations, manifests, the publish protocol, save and restore;
    # the same sealed directories in an object store, and its lease.
    {"trainer.checkpoint", "trainer.storage"},
    # What a run is made of, each usable on its own.
    {"trainer.run.state", "trainer.run.cadence", "trainer.checkpoint.retention", "trainer.checkpoint.export", "trainer.storage.lock",
     "trainer.run.preemption", "trainer.run.events", "trainer.run.batching", "trainer.run.fetching", "trainer.run.fingerprint",
     "trainer.workload", "trainer.run.attempts", "trainer.parallel.ranks", "trainer.run.runtime", "trainer.inspect.compare",
     "trainer.inspect.listing", "trainer.inspect.report", "trainer.inspect.timeline", "trainer.run.progress", "trainer.storage.object.tiering",
     "trainer.inspect.object_store"},
    # Saving on cadence and stepping the optimizer, then the loop that runs one attempt.
    {"trainer.run.saving", "trainer.run.stepping", "trainer.storage.object.backend"},
    {"trainer.run.loop"},
    # The edges: Polyaxon tracking and where a tracked run keeps its run directory, the command line.
    {"trainer.integrations.polyaxon.tracking", "trainer.integrations.polyaxon.placement"},
    {"trainer.cli", "trainer.__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    for index, members in enumerate(LAYERS):
        if any(module == member or module.startswith(member + ".") for member in members):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")


def trainer_imports(path: Path) -> set[str]:
    """Every trainer module the file imports, at any depth (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            # `from trainer import seams` imports a module; `from trainer.x import Y` a name in x.
            found |= {name if (PACKAGE / Path(*name.split(".")[1:])).with_suffix(".py").exists() else node.module
                      for name in names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("trainer")}
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_imports_a_higher_layer(path):
    module = module_name(path)
    upward = sorted(imported for imported in trainer_imports(path) if layer_of(imported) > layer_of(module))
    assert not upward, f"{module} (layer {layer_of(module)}) imports {upward} from a higher layer"


def test_recovery_imports_nothing_from_the_run_around_it():
    forbidden = {"trainer.run.loop", "trainer.cli", "trainer.parallel.ranks", "trainer.integrations.polyaxon.tracking", "trainer.run.attempts"}
    for path in sorted((PACKAGE / "checkpoint").glob("*.py")):
        assert not trainer_imports(path) & forbidden, path


def test_the_layer_check_can_fail():
    """The checker sees an upward import when there is one (so the tests above can fail)."""
    assert "trainer.run.loop" in trainer_imports(PACKAGE / "cli.py")
    assert layer_of("trainer.run.loop") > layer_of("trainer.checkpoint.checkpointer")
    assert layer_of("trainer.checkpoint.section") > layer_of("trainer.layout")


def test_the_loop_depends_on_the_workload_protocol_not_the_example():
    imported = trainer_imports(PACKAGE / "run" / "loop.py") | trainer_imports(PACKAGE / "run" / "saving.py")
    assert not any(name.startswith("trainer.workload.example") or name.startswith("trainer.workload.data")
                   for name in imported), imported
