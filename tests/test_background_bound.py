"""No hang, bounded by configuration: the background gloo groups of async saves wait a bounded
time for a peer (`--background-timeout-secs`; auto: from the saves measured), not torch's 30
minutes, so a failure inside one rank's staging or committer thread reaches every rank, as one
line naming that rank.

End to end under real torchrun (2 processes, gloo, async, 1 epoch: one save, then the end):
rank 1's thread raises an I/O error (a raise seam); rank 0's background collectives wait for it
at most the bound (5 s here), then every rank exits 74 with rank 0's one line naming rank 1. Before, rank 0
waited 30 minutes (measured: with an 1800 s bound the same run was still waiting when killed at
120 s). Cost: about 9 s of CPU per case (about 25 s of wall time on the shared 2 cores).
"""

from __future__ import annotations

import time

import pytest

from support.cli import completed
from support.limits import scaled
from support.torchrun import clean_environment, launch
from trainer.config import BackgroundWaitConfig
from trainer.cli import trainer_parser
from trainer.flags import DEFAULTS, config_from_values

BOUND_S = 5


def test_the_bound_follows_the_slowest_save_with_a_floor_and_an_option():
    auto = BackgroundWaitConfig()
    assert auto.bound_s(None) == auto.first_s < 30 * 60  # before any save: well under torch's 30 minutes
    assert auto.bound_s(1.0) == auto.floor_s
    assert auto.bound_s(100.0) == 100.0 * auto.factor
    assert BackgroundWaitConfig(timeout_s=7.0).bound_s(1000.0) == 7.0
    parser = trainer_parser()
    for argv, expected in (([], None), (["--background-timeout-secs", "auto"], None),
                           (["--background-timeout-secs", "7"], 7.0)):
        config = config_from_values(parser.parse_args(["--output", "x", *argv]), (), location=None)
        assert config.background_wait.timeout_s == expected
    assert DEFAULTS.background_wait == auto


@pytest.mark.parametrize("point", ["after-staging", "after-write"])  # the staging thread, the committer thread
def test_a_background_failure_on_one_rank_reaches_every_rank_within_the_bound(point, tmp_path):
    status = tmp_path / "status"
    command = ["--standalone", "--nproc_per_node", "2", "-m", "trainer", "--output",
               str(tmp_path / "run"), "--threads", "1", "--epochs", "1", "--checkpoint-mode", "async",
               "--background-timeout-secs", str(BOUND_S)]
    started = time.monotonic()
    result = completed(launch(command, clean_environment(TRAINER_EXIT_STATUS_FILE=str(status), TRAINER_RAISE_POINT=point,
                                                        TRAINER_FAULT_RANK="1")), 150)
    elapsed = time.monotonic() - started
    assert int(status.read_text()) == 74, result.stderr[-3000:]  # the seam's error is an I/O error (EIO)
    lines = [line for line in result.stderr.splitlines() if line.startswith("trainer:")]
    assert len(lines) == 1, result.stderr[-3000:]  # rank 0's line, naming rank 1's own failure
    assert lines[0].startswith("trainer: error: rank 1: writing generation step-00000008 failed: Input/output error "
                               f"(fault injection: raising at {point})"), lines[0]
    assert elapsed < scaled(60), f"took {elapsed:.0f} s"
    assert not (tmp_path / "run" / "checkpoints" / "step-00000008").exists()
