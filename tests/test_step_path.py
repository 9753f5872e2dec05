"""The per-step path of both loops never waits on the device (trainer/run/readback.py): per
step, no blocking collective and no host read of a value the step produced, in one process and
in two ranks, the trainer's own loop and a user's loop through `trainer.recovery`.

Measured on CPU by the probe (tests/step_probe.py) that the training processes install: it
records which tensors trainer code reads (`.item()`, `.tolist()`, `.cpu()`, `float()`) in the
window that made them and which collectives it calls blocking; on CUDA each such read would
stop the CPU from queueing the next step's kernels. The first window (the first step's DDP
replica check) and the last (the final save, which reads everything) are off the per-step path.
"""

from __future__ import annotations

import json

import pytest

from support.cli import REPO, run_cli
from support.torchrun import rank_processes

STEPS = 8
TRAINER = ("--workload", f"{REPO}/tests/workloads/probed.py:ToyWorkload", "--toy-samples", 48, "--batch-size", 6,
           "--epochs", 1, "--recover-every-steps", 1000)
LOOP = REPO / "tests" / "workloads" / "probed_loop.py"


def per_step(report: dict) -> dict:
    """The windows of the per-step path (2..STEPS-1): what each read, called and waited for."""
    path = range(2, STEPS)
    assert report["windows"] >= STEPS - 1, report
    return {"reads": [read for read in report["reads"] if read[0] in path],
            "blocking": [call for call in report["blocking"] if call[0] in path],
            "same_window_waits": [wait for wait in report["waits"] if wait[1] in path and wait[0] == wait[1]],
            "agreements": sorted(wait[1] for wait in report["waits"] if wait[1] in path and wait[0] == wait[1] - 1)}


def reports(out, ranks: int) -> list[dict]:
    return [per_step(json.loads((out.parent / f"{out.name}.{rank}.json").read_text())) for rank in range(ranks)]


@pytest.mark.parametrize("loop", ["trainer", "library"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_step_reads_nothing_it_produced_and_waits_on_no_collective(tmp_path, loop, ranks):
    """Cost (TEST_CPU_LOG): 0.3 CPU-s in one process, 0.6-0.9 in two (forked from the zygote, 8
    tiny steps)."""
    out, run = tmp_path / "probe", tmp_path / "run"
    if loop == "trainer":
        argv = ["-m", "trainer", "--output", str(run), "--threads", "1", *map(str, TRAINER)]
        env = {"STEP_PROBE_OUT": str(out)}
    else:
        argv, env = [str(LOOP), str(run), str(out)], {}
    if ranks == 1:
        finished = run_cli(*argv[2:] if loop == "trainer" else argv, env=env)
        assert finished.returncode == 0, finished.stderr[-3000:]
    else:
        rank_processes(argv, ranks, expect=0, env=env)
    for report in reports(out, ranks):
        assert report["reads"] == [] and report["blocking"] == [] and report["same_window_waits"] == [], report
        # Under torchrun every step's agreement is started in the step before and read in this one.
        assert report["agreements"] == (list(range(2, STEPS)) if ranks > 1 else []), report


def test_the_next_step_point_is_the_one_the_step_reaches():
    """Rank 0 votes for step N+1 before it runs (`next_point`): the point it predicts is the
    one `Progress.advance` then reaches, across ragged last windows and epoch ends."""
    from trainer.run.cadence import StepPoint
    from trainer.run.readback import next_point
    from trainer.run.state import Progress

    for batches in range(1, 8):
        for window in range(1, 5):
            progress = Progress()
            for _ in range(3 * batches):
                predicted = next_point(progress, window, batches)
                completed = progress.advance(min(window, batches - progress.position), batches)
                assert predicted == StepPoint(progress.global_step, progress.epoch, completed)
