"""The Polyaxon bundle (polyaxonfiles, presets) and `polyaxon check` on combinations of them."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from support.cli import REPO
from support.limits import scaled

POLYAXON = Path(sys.executable).with_name("polyaxon")
POLYAXONFILES = sorted((REPO / "polyaxonfiles").glob("*.yaml"))
PRESETS = sorted((REPO / "presets").glob("*.yaml"))
JOB_FILE = REPO / "polyaxonfiles" / "polyaxonfile.yaml"
COMBINES = re.compile(r"^# Combines with: (.+)$", re.MULTILINE)
FLAG = re.compile(r"^(--[a-z0-9-]+)=")
"""The trainer flag an input's `argFormat` starts with."""


def preset_targets(preset: Path) -> list[Path]:
    """The polyaxonfiles a preset says (in its `# Combines with:` line) it is meant for."""
    match = COMBINES.search(preset.read_text())
    assert match, f"{preset.name} must say at its top which polyaxonfiles it combines with"
    named = match.group(1).strip()
    if named == "every polyaxonfiles/*.yaml":
        return POLYAXONFILES
    return [REPO / name for name in named.split()]


def check_argv(files: list[Path], params: tuple[str, ...] = ()) -> list[str]:
    """`polyaxon check --strict-params -f FILE... -P PARAM...`, without the `polyaxon`."""
    argv = ["check", "--strict-params"]
    for file in files:
        argv += ["-f", str(file)]
    for param in params:
        argv += ["-P", param]
    return argv


def polyaxon_check(env: dict, files: list[Path], params: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """One `polyaxon check` as its own process (the `polyaxon` script)."""
    return subprocess.run([str(POLYAXON), *check_argv(files, params)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=scaled(300))


def check_all(env: dict, cases: list[tuple[list[Path], tuple[str, ...]]]) -> list[subprocess.CompletedProcess]:
    """`polyaxon check` on each case, each its own process forked from one interpreter that
    imported the CLI once (tests/polyaxon_checks.py): about 0.1 s of CPU a case, not 2.3."""
    argvs = [check_argv(*case) for case in cases]
    driver = subprocess.run([sys.executable, str(REPO / "tests" / "polyaxon_checks.py")], input=json.dumps(argvs),
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert driver.returncode == 0, driver.stderr[-3000:]
    return [subprocess.CompletedProcess([str(POLYAXON), *argv], result["returncode"], result["stdout"],
                                        result["stderr"])
            for argv, result in zip(argvs, json.loads(driver.stdout), strict=True)]


def trainer_argv(script: str) -> list[str]:
    """The trainer's arguments in a rendered container script: those after `python -m trainer`,
    or after `python -m trainer.recovery --script=FILE [--script-args=ARGS]` (your own script,
    presets/own-script.yaml), which takes the same options."""
    tail = script.split("-m trainer", 1)[1]
    argv = shlex.split(re.split(r"[;&\n]", tail)[0])
    if argv[:1] == [".recovery"]:
        assert any(arg.startswith("--script=") for arg in argv), argv
        argv = [arg for arg in argv[1:] if not arg.startswith(("--script=", "--script-args="))]
    return argv
