"""Exact at every world size: for 2, 3 and 4 processes, DDP and FSDP2, an interrupted-and-resumed
run ends bit-identical to the uninterrupted one, sync and async, on one disk and in the object
store; a world-size change under the override is deterministic run to run; and the exactness
witness says so in the attempt records (and says so when it is not, in test_witness.py).

Why 3 and 4: a sum of two ranks' values is the same in either order, a sum of three is not. DDP
rebuilds its gradient buckets after the first step, so a fresh process reduced each gradient
element in a different order from the uninterrupted run, until the gradients were all-reduced
in a layout of their own (trainer/parallel/reduction.py: `fixed-buckets`, the default these
cells run; `per-parameter`'s resume is test_reduction.py's).
One process is proven by test_async_checkpoint.py and test_store.py.

Every dimension is covered at 3 and 4 processes, one resume per (world size, data parallel),
pairwise: each world size and each kind of data parallelism resumes once on disk and once in the
object store, once writing sync and once async. Each has a baseline on disk, sync, saving every 4
steps (step-4, step-8, step-12), and one resume:
- disk: a copy of the baseline that lost step-12 resumes from step-8 with async saves, and
  replays the steps the baseline computed (the witness compares all four);
- store: a run in the object store interrupted at step 10 with async saves, resumed with sync
  saves on a new node.
A launcher does not change a bit, and no launch is under test here: every run forks its ranks
from the worker's zygote with the variables a launcher sets (`trainer_ranks`: no agent, no fresh
interpreters). A real launcher is proven to change no bit where the launch is the contract, a
torchrun run ending equal to a forked reference: test_store_pods.py (torchrun nodes on one object
store, its ring of three equal to this file's 3-process DDP baseline), test_scale_out.py (2),
test_streaming.py (4), test_library_ranks.py and test_framework_ranks.py (3).
Two processes are proven by test_scale_out.py (DDP and FSDP2 on disk, async) and
test_store_pods.py (DDP over two nodes in the store); one by test_async_checkpoint.py and
test_store.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.cli import compare, one_error_line, train
from support.runs import MATRIX_ARGS, attempts, generation, matrix_baseline
from support.s3 import store_env
from support.torchrun import trainer_ranks
from throttle_proxy import ThrottlingProxy

STEPS_ARGS = MATRIX_ARGS
FINAL = "step-00000012"
THROTTLE_RATE = 10
"""Requests a second the store front forwards in the store cells; above it, 503 SlowDown."""
def cell(world_size: int, parallel: str):
    """A (world size, data parallel) cell, on one worker with every test of its baseline."""
    return pytest.param(world_size, parallel, marks=pytest.mark.xdist_group(f"matrix-{world_size}-{parallel}"))


ON_DISK = [cell(3, "ddp"), cell(4, "fsdp")]
IN_THE_STORE = [cell(3, "fsdp"), cell(4, "ddp")]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """The uninterrupted run of each cell, made on first use."""
    return lambda world_size, parallel: matrix_baseline(tmp_path_factory, world_size, parallel)


def assert_witnessed_exact(record: dict, replayed: int) -> None:
    assert record["exactness"] == {"exact": True}
    assert record["restore_check"] == {"matched": True}, record["restore_check"]
    assert record["replay"]["matched"] == record["replay"]["of"] == replayed, record["replay"]
    assert record["replay"]["first_mismatch"] is None


@pytest.mark.parametrize("world_size, parallel", ON_DISK)
def test_a_resume_on_disk_is_exact(world_size, parallel, baselines, tmp_path):
    baseline = baselines(world_size, parallel)
    run = tmp_path / "run"
    shutil.copytree(baseline, run)  # the worker was lost after step 12 was computed, before its save
    for section in ("checkpoints", "exports"):
        shutil.rmtree(run / section / FINAL)
    resumed = trainer_ranks(run, *STEPS_ARGS, "--data-parallel", parallel, "--checkpoint-mode", "async", "--resume",
                            nproc=world_size)
    assert "restored step-00000008" in resumed.stdout
    result = compare(generation(baseline, FINAL), generation(run, FINAL))
    assert result.returncode == 0, result.stdout[-3000:]
    assert_witnessed_exact(attempts(run)[-1], replayed=4)


@pytest.mark.parametrize("world_size, parallel", IN_THE_STORE)
def test_a_resume_in_the_object_store_is_exact(world_size, parallel, baselines, s3_server, s3_bucket, tmp_path):
    """Every rank saves and restores through a store that throttles: a loopback front on the
    SeaweedFS answering `503 SlowDown` above THROTTLE_RATE requests a second (as S3 does to a
    burst on one prefix). Each throttled request is retried with jittered backoff within the
    --store-* bounds; nothing is lost or torn, and the resume is exact."""
    baseline = baselines(world_size, parallel)
    with ThrottlingProxy(s3_server.port, THROTTLE_RATE) as proxy:
        url, env = f"s3://{s3_bucket.name}/run", store_env(s3_server, AWS_ENDPOINT_URL=proxy.endpoint_url)
        common = (*STEPS_ARGS, "--data-parallel", parallel, "--store-retries", 8, "--store-backoff-secs", 0.2)
        first = trainer_ranks(url, *common, "--local-tier", tmp_path / "node-a", "--checkpoint-mode", "async",
                              "--interrupt-at-step", 10, expect=75, nproc=world_size, env=env)
        # A new node: its local tier is empty; the lost attempt's records and step digests come from the store.
        resumed = trainer_ranks(url, *common, "--local-tier", tmp_path / "node-b", "--checkpoint-mode", "sync",
                                "--resume", nproc=world_size, env=env)
        assert proxy.throttled > 0 and proxy.forwarded > 0, (proxy.throttled, proxy.forwarded)
    assert "restored step-00000008" in resumed.stdout
    said = first.stdout + first.stderr + resumed.stdout + resumed.stderr
    assert "SlowDown" in said and "Traceback" not in said  # a retry's warning line names S3's code
    env = store_env(s3_server)
    result = compare(generation(baseline, FINAL), f"{url}/checkpoints/{FINAL}", env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    assert_witnessed_exact(attempts(tmp_path / "node-b")[-1], replayed=2)


@pytest.mark.xdist_group("matrix-4-ddp")
def test_a_world_size_change_is_deterministic_run_to_run(baselines, tmp_path):
    """4 → 3 under the override: not equal to any uninterrupted run (the global batch is summed
    over other ranks), but two such resumes of one generation end identical, and the witness
    does not claim a replay it cannot make."""
    baseline = baselines(4, "ddp")
    finals = []
    for copy in ("a", "b"):
        run = tmp_path / copy
        shutil.copytree(baseline, run)
        for section in ("checkpoints", "exports"):
            shutil.rmtree(run / section / FINAL)
        trainer_ranks(run, *STEPS_ARGS, "--resume", "--allow-drift", "world_size", nproc=3)  # launch not under test
        record = attempts(run)[-1]
        assert record["world_size_change"]["exact"] is False
        assert record["replay"]["compared"] is False and "world_size" in record["replay"]["reason"]
        assert record["restore_check"] == {"compared": False, "reason": "allowed drift (world_size: 4 → 3)"}
        finals.append(generation(run, FINAL))
    assert compare(*finals).returncode == 0
    assert compare(generation(baseline, FINAL), finals[0]).returncode == 1, "3 ranks sum in another order than 4"


def test_bucketed_reduction_with_three_ranks_is_not_exact_and_says_so(tmp_path):
    """The failure this matrix exists for: DDP's own all-reduce of whole buckets, 3 ranks. The run says at start
    that it cannot be exact, records why, and the witness sees the resume diverge from the
    first replayed step: without compare.py, on the cluster."""
    args = (*STEPS_ARGS, "--gradient-reduction", "bucketed", "--checkpoint-mode", "sync")
    baseline = tmp_path / "baseline"
    started = trainer_ranks(baseline, *args, nproc=3)  # the reference: its launch is not under test
    assert "not exact: --gradient-reduction bucketed with 3 processes" in started.stdout + started.stderr
    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    for section in ("checkpoints", "exports"):
        shutil.rmtree(run / section / FINAL)
    resumed = trainer_ranks(run, *args, "--resume", nproc=3)  # its launch is not under test
    assert compare(generation(baseline, FINAL), generation(run, FINAL)).returncode == 1
    record = attempts(run)[-1]
    assert record["exactness"]["exact"] is False and "--gradient-reduction fixed-buckets" in record["exactness"]["reason"]
    assert record["restore_check"] == {"matched": True}, "the restore itself is right; the reduction is not"
    assert record["replay"]["first_mismatch"] == 9 and record["replay"]["matched"] == 0, record["replay"]
    assert "exactness witness: replayed step 9 differs" in resumed.stdout + resumed.stderr


def test_a_ddp_reduction_with_fsdp_is_a_one_line_usage_error(tmp_path):
    line = one_error_line(train(tmp_path / "run", "--data-parallel", "fsdp", "--gradient-reduction", "bucketed",
                                expect=2))
    assert line == ("trainer: error: --gradient-reduction bucketed chooses how DDP all-reduces gradients; "
                    "--data-parallel fsdp reduce-scatters them instead (exact as it is): drop --gradient-reduction")
    assert not (tmp_path / "run").exists()
