"""The package's layering, read from the source: dependencies point one way (recovery → cli →
integrations → run → inspect, parts → data → workload → storage → checkpoint → leaves), the
loop never asks which backend holds the run directory, and it reads in one sitting."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from support.cli import REPO

PACKAGE = REPO / "trainer"

LAYERS = [
    # Leaves: names, errors, configuration, test seams, private-API wrappers, the launcher's variables.
    {"trainer.errors", "trainer.layout", "trainer.config", "trainer.parallel.launch", "trainer.parallel.spare", "trainer.parallel.silence", "trainer.parallel.cuda_fork", "trainer.seams",
     "trainer.compat", "trainer.options", "trainer.location", "trainer.run.interval", "trainer.run.records",
     "trainer.origin"},
    # Generations and exports: manifests, the atomic publish, DCP writes and reads, save and restore.
    {"trainer.checkpoint"},
    # Where a run directory lives: one backend interface, local disk or an object store.
    {"trainer.storage"},
    # The user's side: the `Workload` protocol, the example, the adapters of loaders and streams.
    {"trainer.workload"},
    # The data both loops read (ours, and a user's through `KeyedData`): order, fetching,
    # streams and their cursors, the sample ledger.
    {"trainer.data"},
    # What a run is made of, each usable on its own; the read-only commands.
    {"trainer.run.state", "trainer.run.cadence", "trainer.run.preemption", "trainer.run.events",
     "trainer.run.fingerprint", "trainer.run.attempts", "trainer.run.runtime", "trainer.run.progress",
     "trainer.run.witness", "trainer.run.checksum", "trainer.run.replicas", "trainer.parallel.ranks",
     "trainer.parallel.hostcopy",
     "trainer.parallel.heartbeat", "trainer.parallel.reduction", "trainer.parallel.rendezvous", "trainer.inspect"},
    # One attempt, bottom up: stepping, saving on cadence and the claim; the record, the
    # restore and the training steps; the loop that runs them.
    {"trainer.run.saving", "trainer.run.stepping", "trainer.run.claim", "trainer.run.readback"},
    {"trainer.run.recording", "trainer.run.restoring", "trainer.run.training", "trainer.run.failures",
     "trainer.run.session"},
    {"trainer.run.loop"},
    # The edges: Polyaxon, then the command line.
    {"trainer.integrations"},
    {"trainer.flags", "trainer.cli", "trainer.__main__"},
    # Recovery inside a user's own loop (the same pieces as the loop, the adapters, the bundle's
    # launcher): an entry point like the command line, whose parsing it reuses.
    {"trainer.recovery", "trainer.launch"},
]
PACKAGES = ["trainer.run", "trainer.parallel", "trainer.checkpoint", "trainer.storage", "trainer.inspect",
            "trainer.integrations", "trainer.workload", "trainer.data", "trainer.recovery"]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of the longest entry that names the module or a package above it. The
    package's own `__init__` is a leaf: it imports only the check of where it came from."""
    if module == "trainer":
        return 0
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
    """Top level holds only the leaves and the entry points (the command line, the launch entry
    for a user's script); everything else is in a package."""
    top = {module_name(path) for path in PACKAGE.glob("*.py")}
    assert top == {"trainer", "trainer.__main__", "trainer.cli", "trainer.launch", "trainer.flags", "trainer.errors", "trainer.layout",
                   "trainer.config", "trainer.seams", "trainer.compat", "trainer.options", "trainer.location",
                   "trainer.origin"}, top
    assert {module_name(path.parent / "__init__.py") for path in PACKAGE.glob("*/__init__.py")} | {"trainer.workload"} \
        >= {p for p in PACKAGES}


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of `graph` (name → the names it imports) as a trail, or None."""
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> list[str] | None:
        if state.get(name) == 2:
            return None
        if state.get(name) == 1:
            return trail + [name]
        state[name] = 1
        for imported in sorted(graph.get(name, ())):
            if cycle := visit(imported, trail + [name]):
                return cycle
        state[name] = 2
        return None

    return next((cycle for name in sorted(graph) if (cycle := visit(name, []))), None)


def package_of(module: str) -> str:
    """`trainer.run.loop` → `trainer.run`; a top-level module is a package of its own."""
    return ".".join(module.split(".")[:2])


def package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, imported in modules.items():
        graph.setdefault(package_of(module), set()).update(
            package_of(name) for name in imported if package_of(name) != package_of(module))
    return graph


def test_no_import_cycles_between_modules():
    graph = {module_name(path): trainer_imports(path, top_level_only=True) for path in SOURCES}
    cycle = first_cycle(graph)
    assert cycle is None, f"import cycle: {' → '.join(cycle)}"


def test_no_import_cycles_between_packages():
    """Packages (and top-level modules) import each other one way, lazy imports included: a
    circle of packages (checkpoint → config → storage → checkpoint, when config.py imported a
    module of storage/) is a layering no one can draw."""
    cycle = first_cycle(package_graph({module_name(path): trainer_imports(path) for path in SOURCES}))
    assert cycle is None, f"package circle: {' → '.join(cycle)}"


def test_the_cycle_checks_can_fail():
    modules = {"trainer.checkpoint.section": {"trainer.config"}, "trainer.config": {"trainer.storage.location"},
               "trainer.storage.base": {"trainer.checkpoint.section"}, "trainer.storage.location": set()}
    assert first_cycle(modules) is None  # no module circle...
    assert first_cycle(package_graph(modules)) == ["trainer.checkpoint", "trainer.config", "trainer.storage",
                                                   "trainer.checkpoint"]  # ...but a package circle


CLASS_LINES = 250


def long_classes(path: Path, limit: int = CLASS_LINES) -> list[str]:
    return [f"{path.name}:{node.name} is {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit]


def test_no_class_is_over_250_lines():
    assert [found for path in SOURCES for found in long_classes(path)] == []


def test_the_class_size_check_can_fail(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("class Big:\n" + "    x = 1\n" * CLASS_LINES + "\n\nclass Small:\n    pass\n")
    assert long_classes(sample) == [f"sample.py:Big is {CLASS_LINES + 1} lines"]


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


def test_the_data_imports_neither_loop_nor_the_library_nor_the_backends():
    """Both loops read the data through `trainer/data/` (the trainer's own and a user's through
    `recovery.KeyedData`), so it stands below both: nothing of `run/` (its leaves included),
    `recovery/`, the launch, the checkpoints or the backends; the walk from a user's `KeyedData`
    to the ledger goes down only."""
    for path in sorted((PACKAGE / "data").glob("*.py")):
        imported = trainer_imports(path)
        assert not {name for name in imported if name.split(".")[1] in {
            "run", "recovery", "parallel", "checkpoint", "storage", "inspect", "integrations", "cli", "flags"}}, \
            (path.name, imported)


def test_the_layer_check_can_fail():
    """The checker sees an upward import when there is one (so the tests above can fail)."""
    assert "trainer.run.loop" in trainer_imports(PACKAGE / "cli.py")
    assert layer_of("trainer.run.loop") > layer_of("trainer.checkpoint.checkpointer")
    assert layer_of("trainer.checkpoint.section") > layer_of("trainer.layout")
    assert layer_of("trainer.storage.base") > layer_of("trainer.checkpoint.section")
    assert layer_of("trainer.location") < layer_of("trainer.checkpoint.section")
    assert layer_of("trainer.workload.protocol") < layer_of("trainer.data.keyed") < layer_of("trainer.run.state") \
        < layer_of("trainer.run.training") < layer_of("trainer.recovery.run")


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
            {"trainer.storage.opening"}, (path.name, imported)


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
        guards = role_guards(ast.parse(path.read_text()))
        assert not guards, (path.name, guards)


def role_guards(tree: ast.AST) -> list[str]:
    """`self.x is None` and `self.x is not None` in `tree`: a role asked of an attribute."""
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
            and ast.unparse(node.left).startswith("self.")]


MEMORY = PACKAGE / "storage" / "memory"
TIER0_ROLES = [(MEMORY / "tier.py", "MemoryTier", 9, ["NoMemoryTier", "MemoryDirTier"]),
               (MEMORY / "saves.py", "MemorySaves", 7, ["NoMemorySaves", "MemoryDirSaves"]),
               (MEMORY / "replication.py", "Replication", 5, ["NoReplication", "PeerReplication"])]
"""Tier 0's protocols, their caps, and the implementations of each: the "off" one and the real one."""


@pytest.mark.parametrize("path, protocol, cap, implementations", TIER0_ROLES, ids=[role[1] for role in TIER0_ROLES])
def test_tier0_roles_stay_small_and_each_implementation_answers_its_protocol_alone(path, protocol, cap,
                                                                                    implementations):
    """Each tier-0 role is a protocol of a handful of verbs, answered by an "off" implementation
    and a real one side by side, neither inheriting from the other (a real class that subclasses
    the null object it replaces inherits a role it then overrides), neither asking a role of
    an attribute by `is None` (one node or several, a replica kept or not)."""
    verbs = public_methods(path, protocol)
    assert 0 < len(verbs) <= cap, verbs
    classes = {node.name: node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    for name in implementations:
        assert [ast.unparse(base) for base in classes[name].bases] == [], name
        assert role_guards(classes[name]) == [], name
        assert set(public_methods(path, name)) == set(verbs), name  # helpers stay private


def test_the_tier0_role_checks_can_fail(tmp_path):
    """The shape the review found: a real class inheriting the null object, guarding a role with
    `is None`, with a public helper beside the protocol's verbs."""
    sample = tmp_path / "sample.py"
    sample.write_text("class NoSaves:\n    def save(self):\n        pass\n\n\n"
                      "class Saves(NoSaves):\n    def save(self):\n        if self.replica is not None:\n"
                      "            pass\n\n    def budget(self):\n        pass\n")
    classes = {node.name: node for node in ast.parse(sample.read_text()).body}
    assert [ast.unparse(base) for base in classes["Saves"].bases] == ["NoSaves"]
    assert role_guards(classes["Saves"]) == ["self.replica is not None"]
    assert set(public_methods(sample, "Saves")) - set(public_methods(sample, "NoSaves")) == {"budget"}


def test_both_sections_answer_every_verb_of_the_section_protocol():
    """`Section` (checkpoint/section.py) is what a disk's and a store's sections share: a copy
    or a check that takes either never asks which it holds."""
    verbs = public_methods(PACKAGE / "checkpoint" / "section.py", "Section")
    assert len(verbs) >= 8, verbs
    for path, name in [(PACKAGE / "checkpoint" / "section.py", "LocalSection"),
                       (PACKAGE / "storage" / "object" / "section.py", "ObjectSection")]:
        assert set(verbs) - set(public_methods(path, name)) == set(), name


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


# ----------------------------------------------------------------------------- every page names real things
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""The README and every page of docs/: each names files, modules and options a reader will look
for, and links to sections that must exist."""
CODE = [*PACKAGE.rglob("*.py"), REPO / "compare.py", *(REPO / "bench").glob("*.py"), *(REPO / "examples").glob("*.py"),
        *(REPO / "tests").rglob("*.py")]
FOREIGN_OPTIONS = {
    "torchrun": {"--standalone", "--nnodes", "--node_rank", "--nproc_per_node", "--master_addr", "--master_port",
                 "--node-rank", "--nproc-per-node", "--master-addr", "--master-port", "--max-restarts"},
    "the reader's own workload": {"--mine-width", "--total-steps", "--data-root", "--lr-warmup",
                                  "--reader-shuffle-buffer"},
    "polyaxon": {"--strict-params", "--recompile", "--kind", "--from-file", "--copy"},
    "docker": {"--build-arg"},
    "pytest": {"--dist"},
    "accelerate launch": {"--multi_gpu", "--num_processes"},
    "pip": {"--no-deps", "--force-reinstall", "--no-build-isolation", "--no-index"},
    "argparse": {"--help"},
}
"""Options of other people's tools that the pages show, by tool."""
READERS_OWN_FILES = {"my_workload.py", "trainer.py", "train.py", "my_trainer.py"}
"""Files a page tells the reader to write (docs/workloads.md's walk-through), or names as the
reader's own (docs/library.md: a `trainer.py` of yours shadows the package)."""
READERS_OWN_NAMES = {"trainer.train", "trainer.fit", "trainer.py", "trainer.callbacks.append"}
"""`trainer.…` names that are the reader's objects, not our package (a Hugging Face or
Lightning `trainer` in docs/library.md)."""
REPO_PATH = re.compile(r"(?<![\w./-])((?:trainer|tests|bench|examples|docs|polyaxonfiles|presets|docker)"
                       r"/[\w./*-]*[\w*])")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")


def declared_options() -> set[str]:
    """Every `--option` our code declares (an argparse option, a `Flag`, a workload's or a
    benchmark's own): a string literal of that shape passed to a call (and its `--no-` form
    where the call names argparse's BooleanOptionalAction)."""
    found = set()
    for path in CODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                named = {arg.value for arg in node.args if isinstance(arg, ast.Constant)
                         and isinstance(arg.value, str) and OPTION.fullmatch(arg.value)}
                negated = any(isinstance(part, ast.Attribute) and part.attr == "BooleanOptionalAction"
                              for part in ast.walk(node))
                found |= named | ({"--no-" + option[2:] for option in named} if negated else set())
    return found


def unknown_options(text: str, declared: set[str]) -> list[str]:
    known = declared.union(*FOREIGN_OPTIONS.values())
    return sorted({option for option in OPTION.findall(text) if option not in known})


def anchor_of(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _module_file(parts: list[str]) -> Path | None:
    relative = Path(REPO, *parts)
    return next((path for path in (relative.with_suffix(".py"), relative / "__init__.py") if path.exists()), None)


def missing_names(page: Path, text: str) -> list[str]:
    """What `text` (on `page`) names that does not exist: a repository path, a module by its file
    name, a dotted `trainer.…` name (module, then at most one name defined in it), a link or
    its anchor."""
    missing = []
    for path in REPO_PATH.findall(text):
        if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
            missing.append(f"path {path}")
    file_names = {path.name for path in CODE} | READERS_OWN_FILES
    missing += [f"module {name}" for name in re.findall(r"`(\w+\.py)\b", text) if name not in file_names]
    for dotted, factory in set(re.findall(r"(?<![\w./-])(trainer(?:\.\w+)+)(?::(\w+))?", text)):
        parts = dotted.split(".")
        depth = next((k for k in range(len(parts), 0, -1) if _module_file(parts[:k])), 0)
        rest = parts[depth:] + ([factory] if factory else [])
        defined = depth and len(rest) <= 1 and (not rest or re.search(
            rf"^\s*(def|class) {rest[0]}\b|^{rest[0]}\b\s*[:=]|^from .* import .*\b{rest[0]}\b",
            _module_file(parts[:depth]).read_text(), re.M))
        if not defined and dotted not in READERS_OWN_NAMES:
            missing.append(f"name {dotted}{':' + factory if factory else ''}")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file) if file else page
        if not linked.exists():
            missing.append(f"link {target}")
        elif anchor and anchor not in {anchor_of(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.M)}:
            missing.append(f"anchor {target}")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_file_module_and_link_a_page_names_exists(page):
    assert missing_names(page, page.read_text()) == []


def test_every_option_a_page_names_is_declared_by_our_code_or_a_tool_it_shows():
    declared = declared_options()
    assert {page.name: found for page in PAGES if (found := unknown_options(page.read_text(), declared))} == {}


def test_the_page_checks_can_fail():
    text = ("See `trainer/run/nowhere.py`, `gone.py`, `trainer.run.loop.no_such_name`, "
            "`trainer.workload.example:ExampleWorkload`, [here](README.md#no-such-heading) and "
            "[there](docs/none.md); run with `--resume` or `--no-such-option` under `--nproc_per_node 2`.")
    assert missing_names(REPO / "README.md", text) == [
        "path trainer/run/nowhere.py", "path docs/none.md", "module gone.py", "name trainer.run.loop.no_such_name",
        "anchor README.md#no-such-heading", "link docs/none.md"]
    assert unknown_options(text, declared_options()) == ["--no-such-option"]
    assert anchor_of("Recovery report (`report`)") == "recovery-report-report"
