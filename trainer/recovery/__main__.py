"""`python -m trainer.recovery --script FILE [--script-args "ARGS"] OPTIONS...`: run your own
training script with the trainer's OPTIONS (`--tracked`, `--resume`, cadences, ...) set for
its `recovery.open_run` (trainer/recovery/bundle.py); the bundle's polyaxonfile runs it."""

import argparse
import logging
import os
import runpy
import shlex
import sys

from trainer.recovery.bundle import BUNDLE_ENV

parser = argparse.ArgumentParser(prog="python -m trainer.recovery", allow_abbrev=False)
parser.add_argument("--script", required=True, help="your training script (it calls recovery.open_run)")
parser.add_argument("--script-args", default="", help="the script's own arguments, as one string")
known, options = parser.parse_known_args()
os.environ[BUNDLE_ENV] = shlex.join(options)
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
sys.argv = [known.script, *shlex.split(known.script_args)]
sys.path.insert(0, os.path.dirname(os.path.abspath(known.script)))
runpy.run_path(known.script, run_name="__main__")
