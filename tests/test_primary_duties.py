"""Rank 0's own duties under torchrun, retention and the export, fail every rank: rank 0 alone
removes old generations and writes exports, and a failure there (an I/O error, raised by a seam
right before the removal or the write) reaches every rank at once, as save failures do: every
rank exits 74, rank 0 prints one line, none trains on alone or waits for a rank that stopped.
Cost: about 8 s of CPU per case (2 processes, 1 epoch, gloo; 15-19 s of wall time on the shared 2 cores).
"""

from __future__ import annotations

import time

import pytest

from support.cli import completed
from support.limits import scaled
from support.torchrun import clean_environment, launch


@pytest.mark.parametrize("point, args, line", [
    ("before-retention", ("--recover-every-steps", "2", "--keep-last", "1"),  # step-00000004 prunes step-00000002
     "trainer: error: applying retention failed: Input/output error (fault injection: raising at before-retention)"),
    ("before-export", (),  # the final export, at step 8
     "trainer: error: writing export step-00000008 failed: Input/output error (fault injection: raising at "
     "before-export)"),
])
def test_rank_0s_retention_or_export_failure_ends_every_rank_with_one_line(point, args, line, tmp_path):
    status = tmp_path / "status"
    command = ["--standalone", "--nproc_per_node", "2", "-m", "trainer", "--output",
               str(tmp_path / "run"), "--threads", "1", "--epochs", "1", *args]
    started = time.monotonic()
    result = completed(launch(command, clean_environment(TRAINER_EXIT_STATUS_FILE=str(status), TRAINER_RAISE_POINT=point,
                                                        TRAINER_FAULT_RANK="0")), 150)
    assert int(status.read_text()) == 74, result.stderr[-3000:]
    assert result.stderr.count("exitcode  : 74") == 2, "every rank exits 74, none is stopped by torchrun"
    lines = [text for text in result.stderr.splitlines() if text.startswith("trainer:")]
    assert len(lines) == 1 and lines[0].startswith(line), result.stderr[-3000:]
    assert time.monotonic() - started < scaled(60)
