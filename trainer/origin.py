"""Which `trainer` this is: ours, installed or a checkout, and not another distribution's.

The top-level name `trainer` is not ours alone: Coqui's TTS trainer (`pip install trainer`,
`coqui-tts-trainer`) installs a package `trainer` too. Two such installs into one environment
write into the same `site-packages/trainer/` folder, and whichever came last owns
`__init__.py`; an old copy of this repository left on `PYTHONPATH` wins over the installed
release. Either way imports "work" and run the wrong code, so the import says it in one line.

Cheap on purpose (every start pays it): a checkout (`pyproject.toml` beside `trainer/`) is
taken as chosen, whatever else is installed (the tests run a worktree's code over an editable
install of another checkout); an installed copy costs one `stat` of its own `.dist-info` and
one read of its RECORD. The distributions are searched only once something is wrong.
"""

from __future__ import annotations

import logging
import os
import sys

DISTRIBUTION = "training-recovery"
_DIST_INFO = "training_recovery"
_SEPARATE_VENV = f'install it in a venv of its own (python -m venv VENV && VENV/bin/pip install {DISTRIBUTION})'

log = logging.getLogger("trainer")


def install_extra(extra: str) -> str:
    """The command that adds an optional part (pyproject.toml's extras)."""
    return f'pip install "{DISTRIBUTION}[{extra}]"'


def missing_extra(error: ModuleNotFoundError, extra: str) -> ImportError:
    """An adapter's framework is not installed: the one line that says which extra brings it."""
    return ImportError(f"{error.name} is not installed (an optional part of {DISTRIBUTION}); {install_extra(extra)}")


def check_package(package_dir: str, version: str) -> str | None:
    """A warning line when the package in `package_dir` (ours, being imported) is not one
    clean copy of `version`; None when it is, or when it is a checkout."""
    site = os.path.dirname(package_dir)
    if os.path.isfile(os.path.join(site, "pyproject.toml")):
        return None  # a checkout: run from it on purpose (editable, PYTHONPATH, or its folder)
    record = os.path.join(site, f"{_DIST_INFO}-{version}.dist-info", "RECORD")
    try:
        with open(record, encoding="utf-8") as lines:
            ours = {line.split(",", 1)[0].split("/")[1] for line in lines if line.startswith("trainer/")}
    except OSError:
        return _copy_problem(package_dir, site, version)
    foreign = sorted(set(os.listdir(package_dir)) - ours - {"__pycache__"})
    if not foreign:
        return None
    owners = _owners(site, f"trainer/{foreign[0]}") or ["another distribution"]
    return (f"{package_dir} holds files of {', '.join(owners)} too ({', '.join(foreign[:3])}…): it installs a "
            f"top-level `trainer` as well (Coqui's TTS trainer does) and one install overwrote parts of the "
            f"other; {_SEPARATE_VENV}")


def _copy_problem(package_dir: str, site: str, version: str) -> str | None:
    """Ours is neither a checkout nor the installed distribution's folder: a copy. Only a
    problem when a distribution is installed elsewhere: then this copy hides it."""
    from importlib import metadata

    try:
        installed = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None  # a copy on its own (an image's /opt/…, an upload): nothing it hides
    where = os.path.dirname(str(installed.locate_file("trainer")))
    if os.path.realpath(where) == os.path.realpath(site):
        return None
    return (f"`trainer` was imported from {package_dir} ({version}), a stale copy that hides the installed "
            f"{DISTRIBUTION} {installed.version} in {where}: remove {site} from PYTHONPATH (or delete the "
            f"copy), or run from a checkout")


def foreign_package_problem(package) -> str | None:
    """An error line when `package` (the imported `trainer`) is not ours: another
    distribution's `__init__.py` sits where ours should, and our subpackage is imported
    under it."""
    if getattr(package, "DISTRIBUTION", None) == DISTRIBUTION:
        return None
    init = getattr(package, "__file__", None) or "?"
    owners = _owners(os.path.dirname(os.path.dirname(init)), "trainer/__init__.py") or ["another distribution"]
    return (f"`import trainer` found {init}, which belongs to {', '.join(owners)}, not {DISTRIBUTION}: both "
            f"install a top-level `trainer` (Coqui's TTS trainer does); {_SEPARATE_VENV}, or "
            f"`pip uninstall` the other and `pip install --force-reinstall {DISTRIBUTION}`")


def require_ours() -> None:
    """For our subpackages' entry points: ImportError (one line) under a foreign `trainer`."""
    problem = foreign_package_problem(sys.modules.get("trainer"))
    if problem:
        raise ImportError(problem)


def warn_if_mixed(package_dir: str, version: str) -> None:
    problem = check_package(package_dir, version)
    if problem:
        log.warning("trainer: warning: %s", problem)


def _owners(site: str, path: str) -> list[str]:
    """The distributions in `site` whose RECORD lists `path` (the slow path: only once
    something is already wrong)."""
    owners = []
    try:
        entries = sorted(os.listdir(site))
    except OSError:
        return owners
    for entry in entries:
        if not entry.endswith(".dist-info") or entry.startswith(f"{_DIST_INFO}-"):
            continue
        try:
            with open(os.path.join(site, entry, "RECORD"), encoding="utf-8") as lines:
                if any(line.startswith(f"{path},") for line in lines):
                    name, _, version = entry[:-len(".dist-info")].partition("-")
                    owners.append(f"{name} {version}")
        except OSError:
            continue
    return owners
