"""The launch entry for a user's script (trainer/launch.py, docs/library.md): what it imports
beforehand, its one-line refusals, and a real torchrun launch of a script that creates its own
process group (tests/rejoin_probe.py) through `-m trainer.launch`: round 1's workers are the
warm spare's forks, run the script with torchrun's argv, and rejoin although one starts its
join after the other. The exact kill -9 of a real loop through it:
tests/test_library_ranks.py's `ddp-2-tier0` cell. Cost (TEST_CPU_LOG): about 7 CPU-s (one
torchrun, two interpreters importing torch, two forks of the spare; the rest nothing)."""

from __future__ import annotations

import subprocess
import sys

from support.cli import REPO, completed
from support.limits import scaled
from support.torchrun import clean_environment, launch

from trainer.launch import top_level_imports, warm_up

PROBE = REPO / "tests" / "rejoin_probe.py"


def test_the_scripts_top_level_imports_are_read_from_its_syntax_tree():
    source = """
from __future__ import annotations
import os, numpy as np
from transformers import Trainer, TrainingArguments
from . import sibling
try:
    import accelerate
except ImportError:
    import json
if True:
    from a.b import *
def main():
    import not_top_level
"""
    assert top_level_imports(source) == [("os", ()), ("numpy", ()), ("transformers", ("Trainer", "TrainingArguments")),
                                         ("accelerate", ()), ("json", ()), ("a.b", ())]


def test_an_import_that_fails_is_left_to_the_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import json\nimport no_such_module_of_ours\nfrom os import path, no_such_name\n")
    assert warm_up(str(script)) == ["no_such_module_of_ours"]  # a missing name is the script's to meet


def test_no_script_or_a_missing_one_is_one_line_and_its_exit_code(tmp_path):
    for args, code in (([], 2), (["--nproc", "2"], 2), ([str(tmp_path / "absent.py")], 66)):
        result = subprocess.run([sys.executable, "-m", "trainer.launch", *args], cwd=REPO, capture_output=True,
                                text=True, env=clean_environment(), timeout=scaled(60))
        assert result.returncode == code and len(result.stderr.splitlines()) == 1, result.stderr
        assert "trainer.launch: error:" in result.stderr and "-m trainer.launch SCRIPT" in result.stderr


def test_a_restarted_worker_runs_the_script_from_the_warm_spare_and_its_own_group_rejoins(tmp_path):
    env = clean_environment(PROBE_MARK=str(tmp_path / "mark"), PROBE_TIMEOUT_S=str(scaled(20)))  # not PROBE_KEYED
    command = ["--standalone", "--nproc_per_node", "2", "--max-restarts", "1", "-m", "trainer.launch", PROBE,
               "--an-option", "value"]
    result = completed(launch(command, env), 300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"round 0 rank {rank} joined (2) warm=False argv={PROBE},--an-option,value" in result.stdout
        assert f"round 1 rank {rank} joined (2) warm=True argv={PROBE},--an-option,value" in result.stdout, \
            result.stdout + result.stderr[-3000:]
