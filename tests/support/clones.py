"""A `git clone` of this tree as a new user has it, for the README's make targets
(test_fresh_clone.py, and `make bench` in test_bench.py): the working tree's uncommitted edits
applied, so the tree the next commit holds is what is tested; the clone reuses this checkout's
ready venvs (symlinks), and its requirements files are dated back so that make finds the venvs'
stamps newer and installs nothing; `make()` asserts that it did not."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from support.cli import REPO
from support.limits import scaled

VENVS = (".venv", ".venv-sandbox")
INSTALLS = ("-m venv", "pip install")


def git(*args: str, cwd: Path = REPO, **options) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, **options)


def fresh_clone(folder: Path) -> Path:
    """A fresh clone of this tree in `folder`, its venvs the ready ones."""
    git("clone", "--quiet", "--no-hardlinks", str(REPO), str(folder))
    patch = git("diff", "HEAD", "--binary").stdout
    if patch:
        git("apply", "--whitespace=nowarn", "-", cwd=folder, input=patch)
    for name in git("ls-files", "--others", "--exclude-standard", "-z").stdout.decode().split("\0"):
        if name:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, folder / name)
    for venv in VENVS:
        (folder / venv).symlink_to((REPO / venv).resolve(), target_is_directory=True)
    for requirements in [*folder.glob("requirements*.txt"), folder / "pyproject.toml"]:
        os.utime(requirements, (0, 0))  # older than the stamps: make installs nothing (into the shared venvs)
    return folder


def make_env() -> dict[str, str]:
    """A user's shell: no outer make, no PYTHONPATH, no S3 or Polyaxon settings of ours."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHONPATH")
            and not k.startswith(("AWS_", "POLYAXON_"))}


def make(clone: Path, *targets: str, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(["make", *targets], cwd=clone, env=make_env(), capture_output=True, text=True,
                            timeout=scaled(timeout))
    assert result.returncode == 0, f"make {' '.join(targets)}: exit {result.returncode}\n" \
                                   f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert not any(word in result.stdout for word in INSTALLS), result.stdout[:2000]
    return result
