"""Finding a workload from `--workload MODULE:FACTORY`: importing it, the options it
declares, and the source files the fingerprint hashes.

MODULE is a dotted module name importable from `sys.path` (the current directory first, for
`python -m trainer` and `training-recovery` alike, then what is installed), or a path to a `.py` file, whose folder then goes first on `sys.path`, as
`python file.py` puts it (so a helper beside it imports). Every failure is one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from trainer.errors import UsageError

TRAINER_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class WorkloadFactory:
    spec: str
    """MODULE:FACTORY as given."""
    module: ModuleType
    factory: Callable

    def add_options(self, group) -> dict[str, object]:
        """Let the workload declare its options on `group` (`FACTORY.add_options(group)`,
        optional); returns every declared name with its default."""
        declare = getattr(self.factory, "add_options", None)
        recording = RecordingGroup(group, self)
        if declare is not None:
            try:
                declare(recording)
            except (argparse.ArgumentError, TypeError, ValueError) as error:
                raise UsageError(f"--workload {self.spec}: its add_options failed: {first_line(error)}") from None
        return recording.declared

    def clash(self, names: list[str]) -> UsageError:
        """The workload declared `names`, which the trainer itself defines (a trainer newer than
        the workload may define an option the workload had first)."""
        mine = self.factory.__name__.lower().removesuffix("workload") or "mine"
        return UsageError(f"--workload {self.spec} declares {', '.join(names)}, which the trainer itself defines "
                          f"(python -m trainer --help); rename the workload's option: give each of its options "
                          f"a prefix of its own, e.g. --{mine}-{names[0].lstrip('-')} ({OPTION_NAMING})")

    def defaults(self) -> dict[str, object]:
        """The declared options at their defaults (a workload built without the CLI)."""
        return self.add_options(argparse.ArgumentParser(add_help=False).add_argument_group())

    def source_files(self) -> tuple[Path, ...]:
        """What `source` hashes besides the trainer: the workload's whole top-level package,
        or, for a module in none, every .py file beside it and every module it imported from
        below its folder (`from helpers import my_helpers`: sub-packages at any depth change
        training too); nothing when it lives in the trainer. Call it once the factory ran:
        what the module, or the factory, imported by then is what counts."""
        module_file = Path(self.module.__file__).resolve()
        if module_file.is_relative_to(TRAINER_ROOT):
            return ()
        top = self.module.__name__.split(".")[0]
        package = sys.modules.get(top)
        if top != self.module.__name__ and package is not None and hasattr(package, "__path__"):
            return tuple(sorted(Path(path).resolve() for path in package.__path__))
        folder = module_file.parent
        return tuple(sorted(set(folder.glob("*.py")) | set(imported_below(folder))))


def imported_below(folder: Path) -> list[Path]:
    """The source files of every module imported so far from `folder` or below it, leaving
    out installed packages (a virtual environment inside the project) and the trainer."""
    found = []
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name or not name.endswith(".py"):
            continue
        path = Path(name).resolve()
        if not path.is_relative_to(folder) or path.is_relative_to(TRAINER_ROOT):
            continue
        if not any(part.startswith(".") or part in INSTALLED for part in path.relative_to(folder).parts):
            found.append(path)
    return found


INSTALLED = ("site-packages", "dist-packages")
"""Folders of installed packages: their versions are in the attempt's requirements, not `source`."""


OPTION_NAMING = "docs/workload-options.md"
"""Where the rule for naming a workload's options is written."""
CONFLICT = "conflicting option string"
"""The start of argparse's message when an option is declared twice on one parser."""


class RecordingGroup:
    """An argparse argument group that remembers what the workload declared on it: the names
    become the workload's options (fingerprinted, handed to its factory)."""

    def __init__(self, group, workload: WorkloadFactory):
        self.group, self.workload = group, workload
        self.declared: dict[str, object] = {}
        self.option_strings: set[str] = set()

    def add_argument(self, *args, **kwargs):
        try:
            action = self.group.add_argument(*args, **kwargs)
        except argparse.ArgumentError as error:
            if not error.message.startswith(CONFLICT):
                raise
            taken = error.message.partition(": ")[2].split(", ")
            if set(taken) <= self.option_strings:
                raise UsageError(f"--workload {self.workload.spec} declares {', '.join(taken)} twice in its "
                                 f"add_options") from None
            raise self.workload.clash(taken) from None
        self.option_strings.update(action.option_strings)
        if action.help is None:  # argparse shows the default only beside a help text
            action.help = "(default: %(default)s)"
        self.declared[action.dest] = action.default
        return action

    def set_defaults(self, **settings) -> None:
        """Fixed settings without a flag: fingerprinted all the same."""
        self.group.set_defaults(**settings)
        self.declared.update(settings)

    def __getattr__(self, name):
        return getattr(self.group, name)


def find_factory(spec: str) -> WorkloadFactory:
    module_name, separator, factory_name = spec.rpartition(":")
    if not separator or not module_name or not factory_name:
        raise UsageError(f"--workload {spec!r}: give MODULE:FACTORY, e.g. examples/char_gpt.py:CharGPT "
                         f"or mypackage.workload:MyWorkload")
    module = _import(spec, module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UsageError(f"--workload {spec}: {module_name} has no callable {factory_name!r}")
    return WorkloadFactory(spec, module, factory)


def _import(spec: str, module_name: str) -> ModuleType:
    try:
        if module_name.endswith(".py"):
            return _import_file(Path(module_name))
        return importlib.import_module(module_name)
    except UsageError:
        raise
    except ModuleNotFoundError as error:
        if not module_name.endswith(".py") and _is_the_module_or_its_package(error.name, module_name):
            raise UsageError(f"--workload {spec}: cannot import {module_name} ({error}); run from the directory "
                             f"that holds it, add that directory to PYTHONPATH, or give the path to its .py "
                             f"file") from None
        raise UsageError(f"--workload {spec}: {module_name} imports {error.name!r}, which is not installed in this "
                         f"environment (nor beside the workload); install it (pip install …) or add it to "
                         f"your requirements") from None
    except Exception as error:  # the user's module failed while importing: still one line
        raise UsageError(f"--workload {spec}: importing {module_name} failed: "
                         f"{error.__class__.__name__}: {first_line(error)}") from None


def _is_the_module_or_its_package(missing: str | None, module_name: str) -> bool:
    """Whether the module not found is the one named by --workload (or a package above it),
    rather than a dependency it imports."""
    return missing is None or module_name == missing or module_name.startswith(missing + ".")


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise UsageError(f"--workload {path}: no such file")
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # as `python file.py` does: its helpers beside it import
        sys.path.insert(0, folder)
    name = path.stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path.resolve()):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # DataLoader workers and pickling find it by name
    spec.loader.exec_module(module)
    return module


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else error.__class__.__name__
