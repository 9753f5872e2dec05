"""A model that is not one model across the ranks is refused (trainer/run/replicas.py): under
torchrun a script that never wraps its model in DistributedDataParallel trains one model per
rank, and a generation would keep rank 0's alone. Ranks forked from the zygote with a
launcher's variables (tests/support/torchrun.py), gloo on loopback, the plain loop of
tests/workloads/own_loop_replicas.py:
- never wrapped, 2 ranks: refused after step 1 in one line naming the step, the rank and the
  fix, exit 2 on every rank (the status file too), nothing saved;
- gradients all-reduced by hand, 3 ranks, a BatchNorm's statistics and the RNGs differing per
  rank: not refused (the save at step 2 commits), until the last rank's weights change in step
  3: the save at step 4 refuses naming rank 2 alone, and step 4 is never committed while
  step 2 stays.
DDP and FSDP2 models are the existing rank tests' (tests/test_library_ranks.py, tests/test_framework_ranks.py).
Cost (TEST_CPU_LOG, alone, load 3 to 7): 0.5-0.7 and 1.1-1.4 CPU-s, 6-15 s of wall for both (the
ranks forked from the zygote).
"""

from __future__ import annotations

import json

from support.cli import REPO
from support.runs import attempts
from support.torchrun import rank_processes

SCRIPT = REPO / "tests" / "workloads" / "own_loop_replicas.py"


def refused(tmp_path, nproc: int, *args) -> list:
    status = tmp_path / "status"
    ranks = rank_processes([str(SCRIPT), str(tmp_path / "run"), *args], nproc, expect=2,
                           env={"TRAINER_EXIT_STATUS_FILE": str(status)})
    assert status.read_text().strip() == "2"
    return ranks


def error_lines(ranks) -> list[str]:
    return [line for rank in ranks for line in rank.stderr.splitlines() if "error" in line or "Traceback" in line]


def test_a_model_never_wrapped_in_ddp_is_refused_after_the_first_step_in_one_line(tmp_path):
    lines = error_lines(refused(tmp_path, 2, "unwrapped"))
    assert len(lines) == 1, lines
    assert lines[0].startswith("trainer: error: the model differs between ranks after step 1: rank 1 holds")
    assert "wrap the model in DistributedDataParallel" in lines[0] and "all-reduce its gradients yourself" in lines[0]
    run = tmp_path / "run"
    assert not list((run / "checkpoints").glob("step-*")), "nothing may be saved"
    [record] = attempts(run)
    assert record["status"] == "failed" and record["reason"].startswith("the model differs between ranks")


def test_replicas_kept_equal_by_hand_save_until_one_rank_parts_then_its_save_is_refused(tmp_path):
    lines = error_lines(refused(tmp_path, 3, "by_hand", "drift"))
    assert len(lines) == 1, lines
    assert "after step 4: rank 2 holds other parameters than rank 0" in lines[0]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(path.name for path in checkpoints.glob("step-*")) == ["step-00000002"]
    manifest = json.loads((checkpoints / "step-00000002" / "manifest.json").read_text())
    assert sorted(manifest["state_digest"]) == ["0", "1", "2"]
