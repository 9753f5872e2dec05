"""The toy workload with the step probe on (tests/step_probe.py), for tests/test_step_path.py:
the probe is installed when the trainer imports this module, before the first step, and writes
its report to `STEP_PROBE_OUT.<rank>.json`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the probe
import step_probe  # noqa: E402

from toy import ToyWorkload  # noqa: E402,F401  (a sibling module, as `python file.py` would find it)

step_probe.install(os.environ["STEP_PROBE_OUT"])
