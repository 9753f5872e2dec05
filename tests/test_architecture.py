"""The package's layering, read from the source: dependencies point one way
(cli → integrations → run → inspect, parts → storage → checkpoint → leaves), the loop never
asks which backend holds the run directory, and it reads in one sitting."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "trainer"

LAYERS = [
    # Leaves: names, errors, configuration, test seams, private-API wrappers, the launcher's variables.
    {"trainer.errors", "trainer.layout", "trainer.config", "trainer.parallel.launch", "trainer.seams",
     "trainer.compat", "trainer.options", "trainer.storage.location", "trainer.run.interval", "trainer.run.records"},
    # Generations and exports: manifests, the atomic publish, DCP writes and reads, save and restore.
    {"trainer.checkpoint"},
    # Where a run directory lives: one backend interface, local disk or an object store.
    {"trainer.storage"},
    # What a run is made of, each usable on its own; the read-only commands.
    {"trainer.run.state", "trainer.run.cadence", "trainer.run.preemption", "trainer.run.events",
     "trainer.run.batching", "trainer.run.fetching", "trainer.run.fingerprint", "trainer.run.attempts",
     "trainer.run.runtime", "trainer.run.progress", "trainer.run.witness", "trainer.run.checksum", "trainer.run.ledger",
     "trainer.run.streaming", "trainer.parallel.ranks",
     "trainer.parallel.reduction", "trainer.workload",
     "trainer.inspect"},
    # One attempt, bottom up: stepping, saving on cadence and the claim; the record, the
    # restore and the training steps; the loop that runs them.
    {"trainer.run.saving", "trainer.run.stepping", "trainer.run.claim"},
    {"trainer.run.recording", "trainer.run.restoring", "trainer.run.training", "trainer.run.failures",
     "trainer.run.session"},
    {"trainer.run.loop"},
    # The edges: Polyaxon, then the command line.
    {"trainer.integrations"},
    {"trainer.flags", "trainer.cli", "trainer.__main__"},
    # Recovery inside a user's own loop (the same pieces as the loop, the adapters, the bundle's
    # launcher): an entry point like the command line, whose parsing it reuses.
    {"trainer.recovery"},
]
PACKAGES = ["trainer.run", "trainer.parallel", "trainer.checkpoint", "trainer.storage", "trainer.inspect",
            "trainer.integrations", "trainer.workload", "trainer.recovery"]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of the longest entry that names the module or a package above it."""
    best = None
    for index, members in enumerate(LAYERS):
        for member in members:
            if module == member or module.startswith(member + "."):
                if best is None or len(member) > len(best[1]):
                    best = (index, member)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return best[0]


def trainer_imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Every trainer module the file imports, at any depth (lazy imports count too, unless
    `top_level_only`)."""
    found = set()
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            # `from trainer import seams` imports a module; `from trainer.x import Y` a name in x.
            found |= {name if _is_module(name) else node.module for name in names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("trainer")}
    return found


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative / "__init__.py").exists()


SOURCES = sorted(PACKAGE.rglob("*.py"))
RUN = sorted((PACKAGE / "run").glob("*.py"))
ONE_ATTEMPT = [PACKAGE / "run" / f"{name}.py" for name in ("loop", "claim", "recording", "restoring", "training",
                                                             "saving", "session")]
"""The modules the loop is made of (the parts below them are used elsewhere too)."""


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_imports_a_higher_layer(path):
    module = module_name(path)
    upward = sorted(imported for imported in trainer_imports(path) if layer_of(imported) > layer_of(module))
    assert not upward, f"{module} (layer {layer_of(module)}) imports {upward} from a higher layer"


def test_every_module_lives_in_a_package_by_concern():
    """Top level holds only the leaves and the command line; everything else is in a package."""
    top = {module_name(path) for path in PACKAGE.glob("*.py")}
    assert top == {"trainer", "trainer.__main__", "trainer.cli", "trainer.flags", "trainer.errors", "trainer.layout",
                   "trainer.config", "trainer.seams", "trainer.compat", "trainer.options"}, top
    assert {module_name(path.parent / "__init__.py") for path in PACKAGE.glob("*/__init__.py")} | {"trainer.workload"} \
        >= {p for p in PACKAGES}


def test_no_import_cycles_between_modules():
    graph = {module_name(path): {imported for imported in trainer_imports(path, top_level_only=True)}
             for path in SOURCES}
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        if state.get(module) == 2:
            return
        assert state.get(module) != 1, f"import cycle: {' → '.join(trail + [module])}"
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            visit(imported, trail + [module])
        state[module] = 2

    for module in sorted(graph):
        visit(module, [])


def test_checkpoint_imports_nothing_from_the_run_around_it():
    for path in sorted((PACKAGE / "checkpoint").glob("*.py")):
        imported = trainer_imports(path)
        assert not {name for name in imported if name.split(".")[1] in {"run", "storage", "inspect", "integrations",
                                                                         "cli", "parallel"}}, (path, imported)


BACKEND_WORDS = {"store", "remote", "uploader", "storage", "lease", "tier", "checkpointer"}


def names_a_backend(code: str) -> bool:
    return bool(BACKEND_WORDS & set(re.findall(r"[a-z]+", code.lower())))


def backend_questions(path: Path) -> list[str]:
    """Places where code asks which backend it holds: `x.store is None`, `isinstance(x,
    SomeStorage)`, `getattr(checkpointer, "…")`, or a branch on `config.store`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            if names_a_backend(ast.unparse(node.left)):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "getattr"):
            if names_a_backend(ast.unparse(node)):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.If, ast.IfExp)) and "config.store" in ast.unparse(node.test):
            found.append(f"{path.name}:{node.lineno}: if {ast.unparse(node.test)}")
    return found


@pytest.mark.parametrize("path", RUN, ids=lambda p: p.name)
def test_the_run_never_asks_which_backend_it_holds(path):
    assert not backend_questions(path), backend_questions(path)


def test_the_backend_check_can_fail(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("if self.store is None:\n    pass\nif getattr(self.checkpointer, 'durable_on_save', False):\n"
                      "    pass\nx = 1 if config.store else 2\n")
    assert len(backend_questions(sample)) == 3


def test_the_loop_reads_in_one_sitting():
    """loop.py ≤ 200 lines, no function over 60 lines, no class over 200, no parameter list
    over 6 in the modules of one attempt, and no checkpoint internal imported by the loop."""
    loop = PACKAGE / "run" / "loop.py"
    assert len(loop.read_text().splitlines()) <= 200
    for path in ONE_ATTEMPT:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                assert size <= 60, f"{path.name}:{node.name} is {size} lines"
                arguments = [a for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
                assert len(arguments) <= 6, f"{path.name}:{node.name} takes {len(arguments)} parameters"
            elif isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                assert size <= 200, f"{path.name}:{node.name} is {size} lines"
    assert not {name for name in trainer_imports(loop) if name.startswith(("trainer.checkpoint", "trainer.storage."))
                and name != "trainer.storage.opening"}


def test_the_layer_check_can_fail():
    """The checker sees an upward import when there is one (so the tests above can fail)."""
    assert "trainer.run.loop" in trainer_imports(PACKAGE / "cli.py")
    assert layer_of("trainer.run.loop") > layer_of("trainer.checkpoint.checkpointer")
    assert layer_of("trainer.checkpoint.section") > layer_of("trainer.layout")
    assert layer_of("trainer.storage.base") > layer_of("trainer.checkpoint.section")
    assert layer_of("trainer.storage.location") < layer_of("trainer.checkpoint.section")


def test_the_loop_depends_on_the_workload_protocol_not_the_example():
    imported = set().union(*(trainer_imports(path) for path in RUN))
    assert not any(name.startswith("trainer.workload.example") or name.startswith("trainer.workload.data")
                   for name in imported), imported


def test_integrations_import_no_checkpoint_or_storage_internals():
    """The Polyaxon copy seeds a run through `copy_committed` of the sections that own the
    commit (storage/opening.py hands them out): no third hand-written commit protocol."""
    for path in sorted((PACKAGE / "integrations").rglob("*.py")):
        imported = trainer_imports(path)
        assert not {name for name in imported if name.startswith("trainer.checkpoint")}, (path.name, imported)
        assert {name for name in imported if name.startswith("trainer.storage")} <= \
            {"trainer.storage.opening", "trainer.storage.location"}, (path.name, imported)


def test_the_run_imports_no_object_store_module():
    """The attempt holds a claim and a durability; which object store is behind them is the
    backend's business (storage/opening.py picks it)."""
    for path in RUN:
        assert not {name for name in trainer_imports(path) if name.startswith("trainer.storage.object")}, path.name


def public_methods(path: Path, class_name: str) -> list[str]:
    (node,) = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return [f.name for f in node.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]


def test_the_storage_roles_stay_small_and_ask_no_role_by_none():
    """The claim (`RunStorage`) and the durability each keep a handful of verbs (the review
    found one interface of 22 members), and no backend stands for "rank 0 or not, claimed or
    not" with `self.x is None`: each rank is given the objects that fit it."""
    base = PACKAGE / "storage" / "base.py"
    assert len(public_methods(base, "RunStorage")) <= 10, public_methods(base, "RunStorage")
    assert len(public_methods(base, "Durability")) <= 7, public_methods(base, "Durability")
    for path in [base, PACKAGE / "storage" / "local.py", PACKAGE / "storage" / "object" / "backend.py"]:
        guards = [ast.unparse(node) for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
                  and ast.unparse(node.left).startswith("self.")]
        assert not guards, (path.name, guards)


# ----------------------------------------------------------------------------- docs/architecture.md stays true
ARCHITECTURE = REPO / "docs" / "architecture.md"


def section_of(text: str, heading: str) -> str:
    """The text under a `## ` heading that starts with `heading`, up to the next one."""
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def documented_modules(text: str) -> set[Path]:
    """Every module the package table names, as a path under trainer/."""
    found, package = set(), None
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("| ") else []
        if len(cells) != 3 or cells[0] == "package":
            continue
        package = cells[0].strip("`") if cells[0] else package
        folder = PACKAGE if package == "(top)" else PACKAGE / package
        found |= {folder / name for name in re.findall(r"`(\w+\.py)`", cells[1])}
    return found


def test_every_module_the_architecture_table_names_exists_and_every_module_is_named():
    """A package `__init__.py` or `__main__.py` of a few lines (a docstring, an entry point)
    needs no row."""
    named = documented_modules(ARCHITECTURE.read_text().split("\n## ")[0])  # the table above the walks
    assert sorted(str(path.relative_to(REPO)) for path in named if not path.exists()) == []
    tiny = {path for path in SOURCES if path.name in ("__init__.py", "__main__.py")
            and len(path.read_text().splitlines()) < 5}
    assert sorted(str(path.relative_to(REPO)) for path in set(SOURCES) - named - tiny) == []


def test_every_option_of_help_is_in_the_architecture_table_of_options():
    from trainer.cli import train_parser

    table = section_of(ARCHITECTURE.read_text(), "Where each option")
    options = [action.option_strings[-1] for action in train_parser()._actions if action.option_strings]
    assert [option for option in options if option != "--help" and f"`{option}`" not in table] == []


def test_the_doc_checks_can_fail():
    assert documented_modules("| `run/` | `loop.py`, `nowhere.py` | x |\n| | `claim.py` | y |") == \
        {PACKAGE / "run" / "loop.py", PACKAGE / "run" / "nowhere.py", PACKAGE / "run" / "claim.py"}
