"""The Polyaxon bundle (polyaxonfiles, presets) and `polyaxon check` on combinations of them."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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


def polyaxon_check(env: dict, files: list[Path], params: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    command = [str(POLYAXON), "check", "--strict-params"]
    for file in files:
        command += ["-f", str(file)]
    for param in params:
        command += ["-P", param]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(300))


def check_all(env: dict, cases: list[tuple[list[Path], tuple[str, ...]]]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda case: polyaxon_check(env, *case), cases))


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
