"""Every benchmark runs at its --quick size, so a signature change cannot break one silently:
those `make bench` runs, through `make bench` in a fresh clone (as the README says to run them),
the others one by one. Each one's results are checked where a check says more than "it ran".

Cost: `make bench` about 40 s, scale_out_bench.py about 45 s, goodput_validation.py about 25 s,
memory_tier_bench.py about 20 s (12 s before it restored from the peer: two spawned processes),
library_bench.py 23 CPU s (14 before its plain row on two processes: two more imports of torch).
The ones run one by one are forked from the worker's zygote (torch, and transformers for
library_bench.py, imported once): the seven 127 -> 98 CPU s alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from support.cli import REPO, completed, forked, trainer_env, zygote
from support.clones import fresh_clone, make
from support.limits import scaled

BENCHMARKS = sorted(path for path in (REPO / "bench").glob("*.py") if "--quick" in path.read_text())
MAKE_BENCH = re.findall(r"bench/(\w+\.py) --quick", (REPO / "Makefile").read_text())
"""The benchmarks `make bench` runs, in its order."""


def test_every_benchmark_script_is_covered():
    assert {path.name for path in BENCHMARKS} >= {"checkpoint_bench.py", "loop_overhead.py", "store_bench.py",
                                                  "goodput_sim.py", "goodput_validation.py", "reduction_bench.py",
                                                  "stream_bench.py", "memory_tier_bench.py", "restart_bench.py",
                                                  "startup_bench.py"}


def store_bench_checks(report: dict) -> None:
    """Structure only (figures are not asserted): every path measured, the server found, and
    the back-pressure runs saved max_pending + 1 generations each."""
    for key in ("local_write_s", "sync_store_s", "tiered_blocked_s", "tiered_durable_s", "commit_s",
                "boto3_upload_s", "s3fs_put_s", "fetch_s", "boto3_download_s", "store_restore_s", "local_restore_s",
                "local_one_pass_s", "store_one_pass_s"):
        assert report[key] > 0, key
    assert report["data_bytes"] > 30 << 20
    assert report["server_cpu_known"]  # it started its own server and found its pid
    assert [(b["max_pending"], len(b["per_save"])) for b in report["bursts"]] == [(1, 2), (2, 3)]
    assert set(report["same_round_ratios"]) >= {"commit vs boto3 upload_file (speed)",
                                                "store restore / local restore (time)",
                                                "store restore / one-pass local restore (time)"}


def startup_bench_checks(report: dict) -> None:
    """Structure only: each case measured beyond `import torch` of its round (figures vary by
    seconds on a loaded machine; docs/development.md quotes the quiet rounds)."""
    assert report["rounds"] == 1
    (checkout,) = report["checkouts"].values()
    assert checkout["import_torch"]["wall_s"] > 0 and checkout["import_torch"]["cpu_s"] > 0
    assert set(checkout) == {"import_torch", "from trainer import recovery", "resume to 'restored step-'"}


def goodput_sim_checks(report: dict) -> None:
    """Seeded and pure, so exact enough to assert: auto within a point of the best fixed
    interval of the sweep, and above the default cadence."""
    assert report["auto"]["time_goodput"] >= report["best_fixed"]["time_goodput"] - 0.01
    assert report["auto"]["time_goodput"] > report["every_epoch"]["time_goodput"]
    assert report["daly"]["model_goodput"] >= max(row["model_goodput"] for row in report["fixed"]) - 1e-9


def goodput_validation_checks(report: dict) -> None:
    """Two real kill -9s, replayed by the simulator. Agreement is the bench's own verdict (2
    points, in its table): on a loaded machine step times vary between attempts, and a test's
    verdict must not depend on the machine's speed, so here only that both ran and agree on
    what happened."""
    (row,) = report["rows"]
    assert row["kills"] == 2 and row["attempts"] == 3 and row["simulated_failures"] == 2
    assert 0 < row["measured_step_goodput"] <= 1 and 0 < row["simulated_step_goodput"] <= 1
    assert row["cost_s"] > 0 and row["restart_s"] > 0 and row["step_s"] > 0
    assert "within_tolerance" in row


def scale_out_bench_checks(report: dict) -> None:
    """Structure only: the four runs, each with its saves, and the ratios between them."""
    assert set(report["runs"]) == {"local-sync", "local-async", "store-sync", "store-async"}
    for name, run in report["runs"].items():
        assert run["saves"] == 2 and run["blocked_s"] > 0 and run["committed_s"] > 0, name
        assert run["mode"] == name.split("-")[1], name
    assert {"local async/sync blocked", "store async/sync blocked"} <= set(report["ratios"])


def reduction_bench_checks(report: dict) -> None:
    """Structure only: the reductions ran every round in the same processes."""
    assert [len(report["rates"][name]) for name in ("bucketed", "fixed-buckets", "per-parameter",
                                                    "torch-allreduce-hook")] == [2, 2, 2, 2]
    assert report["vs_bucketed"]["bucketed"] == 1 and report["vs_bucketed"]["fixed-buckets"] > 0


def loop_overhead_checks(report: dict) -> None:
    """Structure only: the witness measured beside what it rides on."""
    witness = report["witness"]
    assert all(witness[key] > 0 for key in ("step_s", "step_digest_s", "state_digest_s", "sync_save_s"))
    assert report["step_cost"]["run_step_s"] > 0 and report["step_cost"]["parameters"] == 64


def stream_bench_checks(report: dict) -> None:
    """Structure only: both readers timed, reading alone and under a training step, per worker count."""
    assert [(row["workers"], row["what"]) for row in report["rows"]] == [
        (0, "reading only"), (0, "training step"), (2, "reading only"), (2, "training step")]
    assert all(row["stream_s"] > 0 and row["plain_s"] > 0 and row["ratio"] > 0 for row in report["rows"])
    amplification = {(row["ranks"], row["workers"], row["lanes"]): row["read_per_record"]
                     for row in report["read_amplification"]}
    assert amplification == {(1, 0, 1): 1.0, (2, 2, 2): 1.0, (4, 2, 4): 1.0, (2, 2, 4): 1.0, (3, 2, 4): 3.0,
                             (3, 2, 12): 1.0}, "once per epoch where the ranks divide the lanes, 3x on 3 of 4"
    assert [(row["ranks"], row["workers"]) for row in report["store"]] == [(1, 0), (2, 2)]
    assert all(1.0 <= row["fetched_per_trained"] < 1.01 for row in report["store"]), "no byte fetched twice"


def data_bench_checks(report: dict) -> None:
    """Structure only: each dataset read both ways at 0 and 2 workers."""
    assert [(row["dataset"], row["workers"]) for row in report["rows"]] == [
        (name, workers) for name in ("plain", "declared", "augmenting", "torch-only") for workers in (0, 2)]
    assert all(row["keyed_us"] > 0 and row["plain_us"] > 0 and row["ratio"] > 0 for row in report["rows"])


def memory_tier_bench_checks(report: dict) -> None:
    """Structure, and one bound: both tiers and the peer restored (fetch, verify and load), the
    loop timed with and without tier-0 saves (sync and async), peak RSS read, the ratios between
    them; a peer fetch streams, so neither end's extra memory reaches two chunks (it was three
    copies of the part, 192 MB at --quick's 64 MB, before)."""
    for key in ("tier0_restore_s", "tier0_verify_s", "tier0_load_s", "disk_restore_s", "disk_warm_restore_s",
                "peer_restore_s", "peer_fetch_s", "peer_verify_s", "peer_load_s", "part_mb", "chunk_mb",
                "tier0_save_s", "disk_save_s", "step_s", "step_with_tier0_s", "step_with_async_tier0_s",
                "tier0_async_blocked_s", "tier0_async_save_s", "peak_rss_mb"):
        assert report[key] > 0, key
    assert report["tier0_async_blocked_s"] < report["tier0_async_save_s"]  # the write ran in the background
    assert report["generation_mb"] > 0.9 * report["state_mb"]
    assert report["peer_receiver_extra_mb"] < 2 * report["chunk_mb"] < report["part_mb"], report
    assert report["peer_sender_extra_mb"] < 2 * report["chunk_mb"], report
    assert report["peer_restore_s"] == pytest.approx(report["peer_fetch_s"] + report["peer_verify_s"]
                                                     + report["peer_load_s"])
    assert {"tier-0 restore / cold disk restore (time)", "peer restore / tier-0 restore (time)",
            "peer restore / cold disk restore (time)", "peak RSS / state"} <= set(report["ratios"])


def restart_bench_checks(report: dict) -> None:
    """A kill -9 of rank 1 under torchrun --max-restarts, of the trainer and of a user's script
    (examples/own_loop_ddp.py, its own group first, through `-m trainer.launch`): the survivor
    named it, the workers were restarted in place (forked from the warm spare) and reached a
    step restored from tier 0, every part of R accounted for; the script's launch ran on to
    its end, equal to an uninterrupted one."""
    trainer, script = report["failures"]
    assert (trainer["script"], script["script"], script["entry"]) == ("trainer", "ddp", "launch"), report
    for failure in (trainer, script):
        assert failure["how"] == "kill" and failure["restored_from"] == "memory" and failure["warm_spare"], failure
        assert failure["r_s"] > 0 and failure["detection_s"] is not None and failure["attempts"] == 2, failure
        for part in ("teardown_s", "imports_s", "join_s", "claim_s", "restore_s", "first_step_s"):
            assert failure[part] is not None, part
    assert script["exact"] is True and script["status"] == 0, script


def heartbeat_bench_checks(report: dict) -> None:
    """Every case measured a beat gap; a call holding the GIL delays the beat by about its length."""
    assert sorted(report["cases"]) == ["fork", "gil-call", "idle", "python", "torch"]
    assert all(case["gap_s"] > 0 for case in report["cases"].values())
    assert report["cases"]["gil-call"]["gap_s"] >= report["cases"]["gil-call"]["longest_item_s"] * 0.9


def library_bench_checks(report: dict) -> None:
    """Every adapter measured against its framework, both ways, on a generation of the state;
    the plain loop on two processes too, both modes against both baselines."""
    assert sorted(report["rows"]) == ["accelerate", "hf", "lightning", "plain"]
    for row in report["rows"].values():
        assert row["mb"] > 0 and all(row[key] > 0 for key in ("save_ratio", "restore_ratio", "async_save_ratio",
                                                              "sync_vs_dcp_durable", "sync_cpu_vs_dcp_durable")), row
    ranks = report["ranks"]
    assert ranks["nproc"] == 2 and ranks["mb"] > 0, ranks
    assert all(ranks[key] > 0 for key in ("async_save_ratio", "sync_vs_dcp_durable")), ranks


def loop_bench_checks(report: dict) -> None:
    """Structure only: every row of issue 55's table timed against the bare loop in one run,
    the default mode named, the save rows' steps with a save in flight measured."""
    assert len(report["rows"]) == 6 and report["default_mode"] in ("sync", "async")
    assert all(row["loop_s"] > 0 and row["vs_bare"] > 0 and row["loop_cpu_s"] >= 0 for row in report["rows"].values())
    assert report["async_vs_dcp_async"] > 0
    assert report["rows"]['trainer.recovery, checkpoint_mode="async"']["in_flight_vs_quiet"] > 0


CHECKS = {"data_bench.py": data_bench_checks, "heartbeat_bench.py": heartbeat_bench_checks,
          "library_bench.py": library_bench_checks, "loop_bench.py": loop_bench_checks, "memory_tier_bench.py": memory_tier_bench_checks,
          "restart_bench.py": restart_bench_checks, "startup_bench.py": startup_bench_checks,
          "stream_bench.py": stream_bench_checks,
          "store_bench.py": store_bench_checks, "scale_out_bench.py": scale_out_bench_checks,
          "goodput_sim.py": goodput_sim_checks, "goodput_validation.py": goodput_validation_checks,
          "reduction_bench.py": reduction_bench_checks, "loop_overhead.py": loop_overhead_checks}


def check(name: str, report: dict) -> None:
    CHECKS.get(name, lambda report: None)(report)


def untracked(clone) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=clone, capture_output=True,
                          text=True, check=True).stdout


def test_make_bench_on_a_fresh_clone_runs_each_quick_benchmark(tmp_path):
    assert MAKE_BENCH[:2] == ["checkpoint_bench.py", "loop_overhead.py"] and "store_bench.py" in MAKE_BENCH
    clone = fresh_clone(tmp_path / "training-recovery")
    results = tmp_path / "results"
    before = untracked(clone)
    made = make(clone, "bench", f"JSON={results}", timeout=900)
    shown = made.stdout
    assert shown.count("|---") >= len(MAKE_BENCH) and "Traceback" not in made.stderr  # each printed its table
    assert untracked(clone) == before  # they wrote nothing into the tree (their scratch: temporary folders)
    assert sorted(path.name for path in results.iterdir()) == sorted(f"{name[:-3]}.json" for name in MAKE_BENCH)
    for name in MAKE_BENCH:
        assert f"bench/{name} --quick" in shown
        check(name, json.loads((results / f"{name[:-3]}.json").read_text()))


@pytest.mark.parametrize("script", [path for path in BENCHMARKS if path.name not in MAKE_BENCH], ids=lambda path: path.name)
def test_benchmark_runs_at_its_quick_size(script, tmp_path, request):
    # No AWS_* from the developer's shell: a benchmark that needs a store starts its own SeaweedFS,
    # but stream_bench.py's few reads go to the suite's (started once per worker).
    env = {name: value for name, value in trainer_env().items() if not name.startswith("AWS_")}
    if script.name == "stream_bench.py":
        env.update(request.getfixturevalue("s3_server").env())
    argv = [str(script), "--quick", "--dir", str(tmp_path), "--json", str(tmp_path / "result.json")]
    # Forked from the worker's zygote (torch imported once; its own runs and workers stay what it starts)
    preload = "transformers" if script.name == "library_bench.py" else None  # its HF row (tests/forking.py)
    result = completed(zygote().spawn(argv, REPO, env, new_session=False, preload=preload) if forked(env, {}) else
                       subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True), 600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "|---" in result.stdout, result.stdout[-2000:]  # it printed its table
    assert "Traceback" not in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["result.json"]  # it cleaned up after itself
    check(script.name, json.loads((tmp_path / "result.json").read_text()))


def test_the_gpu_check_runs_its_whole_plan_on_the_cpu_in_the_time_it_claims(tmp_path):
    """bench/gpu_check.sh --dry-run: every part's code path at tiny sizes, the CUDA-only steps
    skipped with a line each, one summary and one log, exit 0 only when the plan kept its claim.
    About 20 CPU s (its parts are fresh interpreters: pytest of test_compat, the loop, seven trainers and a compare)."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run", str(out)], cwd=tmp_path,
                          env=trainer_env(), capture_output=True, text=True, timeout=scaled(600))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert sorted(path.name for path in out.iterdir() if path.is_file() and not path.name.endswith(".json")) == [
        "gpu_check.log"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and summary["ok"] and summary["seconds"] <= summary["claimed_s"]
    assert list(summary["parts"]) == ["compat", "loop", "exact", "restore", "spare"]
    assert all(part["exit"] == 0 and not part["missed"] for part in summary["parts"].values())
    assert "skipped: host syncs" in done.stdout and "skipped: the in-place restart on CUDA" in done.stdout
    assert summary["parts"]["restore"]["tier0"]["tier"] == "memory"
    assert summary["parts"]["restore"]["disk"]["tier"] == "disk"


def test_the_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_69(tmp_path):
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(tmp_path / "out")], cwd=tmp_path,
                          env=trainer_env(), capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 69
    assert "no CUDA device is visible" in done.stdout and "Traceback" not in done.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["cuda"] is False
