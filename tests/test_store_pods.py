"""Several pods on one store without a shared disk: two torchrun "nodes" on loopback, each with
its own local tier, one S3 server (SeaweedFS). Each rank writes its own shards to the store,
rank 0 commits; each rank restores from its own verified download. And the lease: a zombie
writer whose lease was taken over cannot commit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import compare, finish, one_error_line, run_cli, start, wait_for_line
from support.runs import matrix_baseline
from support.s3 import committed, keys, store_env
from support.torchrun import clean_environment, free_port, launch, rank_processes

EPOCHS = ("--epochs", 2)  # 16 steps with two processes
FINAL = "step-00000016"


def two_nodes(url: str, tmp: Path, *args, env: dict, fault: dict | None = None, per_node: dict | None = None,
              timeout: float = 600, count: int = 2, memory: bool = False,
              node_args: dict | None = None, forked: bool = False) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes 2` twice on loopback (node 0 and node 1, one process each; `count`
    nodes if given), each node with its own --local-tier (an object store `url`) and, with
    `memory`, its own --memory-dir `memory_dir(tmp, node)` (and `per_node[node]` added to its
    environment, `node_args[node]` to its arguments); the trainer's status of each node from
    TRAINER_EXIT_STATUS_FILE. `forked`: each node's rank forked from the zygote with the
    variables torchrun sets on its node (`rank_processes`: no agents, no fresh interpreters),
    for a run whose launch is not under test (a first attempt that leaves what a test resumes)."""
    port = free_port()
    commands, environments, statuses_at = [], [], []
    for node in range(count):
        status = tmp / f"status-{node}-{len(list(tmp.glob(f'status-{node}-*')))}"
        tiers = (["--local-tier", str(tmp / f"node-{node}")] if url.startswith("s3://") else []) + \
            (["--memory-dir", str(memory_dir(tmp, node))] if memory else [])
        commands.append(["-m", "trainer", "--output", url, *tiers,
                         *map(str, EPOCHS + args + (node_args or {}).get(node, ()))])
        environments.append({"TRAINER_EXIT_STATUS_FILE": str(status),
                             **env, **(fault or {}), **(per_node or {}).get(node, {})})
        statuses_at.append(status)
    if forked:
        finished = rank_processes(commands, count, expect=None, env=environments, per_node=1, timeout=timeout)
    else:
        processes = [launch(["--nnodes", str(count), "--node_rank", str(node), "--nproc_per_node", "1",
                             "--master_addr", "127.0.0.1", "--master_port", str(port), *commands[node]],
                            clean_environment(**environments[node])) for node in range(count)]
        outputs = [finish(process, timeout) for process in processes]
        finished = [subprocess.CompletedProcess(process.args, process.returncode, out, err)
                    for process, (out, err) in zip(processes, outputs)]
    for result, status in zip(finished, statuses_at):
        result.trainer_status = int(status.read_text()) if status.exists() else None
    return finished


def memory_dir(tmp: Path, node: int) -> Path:
    """A node's tier 0 (a tmp directory stands in for its /dev/shm)."""
    return tmp / f"shm-{node}"


def statuses(results) -> list:
    return [result.trainer_status for result in results]


def download(server, bucket: str, prefix: str, target: Path) -> Path:
    client = server.client()
    for key in keys(server, bucket, prefix):
        path = target / key[len(prefix):].lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    return target


@pytest.fixture(scope="module")
def baseline_two_nodes(baseline_2p) -> Path:
    """The final generation of the shared uninterrupted 2-process run (`torchrun --standalone`
    on one disk, support.runs): two nodes on one store must end bit-identical to it (the same
    two ranks; where they run and store is no input)."""
    return baseline_2p / "checkpoints" / FINAL


def test_two_nodes_without_a_shared_disk_survive_an_interrupt_and_a_node_killed_mid_save(
        s3_server, s3_bucket, tmp_path, baseline_two_nodes):
    bucket = s3_bucket.name
    url, env = f"s3://{bucket}/run", store_env(s3_server)
    interrupted = two_nodes(url, tmp_path, "--interrupt-at-step", 11, env=env, forked=True)  # launch not under test
    assert statuses(interrupted) == [75, 75]
    assert committed(s3_server, bucket) == ["step-00000008"]
    manifest = json.loads(s3_server.client().get_object(
        Bucket=bucket, Key="run/checkpoints/step-00000008/manifest.json")["Body"].read())
    # Rank 0 committed every rank's shards, hashed by the rank that wrote them.
    assert {name.split("_")[2] for name in manifest["files"] if name.endswith(".distcp")} == {"0", "1"}
    assert manifest["timings"]["mode"] == "sync-store"
    # No node kept a local copy of a save (no shared disk to publish on).
    assert not (tmp_path / "node-1" / "checkpoints" / "step-00000008").exists()

    # Async from here on: each node uploads its shards in the background. Node 1's rank dies
    # by SIGKILL after uploading its first shard of step-00000016.
    crashed = two_nodes(url, tmp_path, "--resume", "--checkpoint-mode", "async", env=env,
                        fault={"TRAINER_FAULT_POINT": "store-after-first-object", "TRAINER_FAULT_RANK": "1"})
    assert "fault injection: killing at store-after-first-object" in crashed[1].stderr
    assert 0 not in statuses(crashed)
    assert committed(s3_server, bucket) == ["step-00000008"]  # the torn step-00000016 is not committed

    resumed = two_nodes(url, tmp_path, "--resume", "--checkpoint-mode", "async", env=env)
    assert statuses(resumed) == [0, 0], resumed[0].stdout[-2000:] + resumed[1].stderr[-2000:]
    assert "restored step-00000008" in resumed[0].stdout
    assert "step-00000016 has no manifest.json" in resumed[0].stdout  # the torn prefix, removed
    final = download(s3_server, bucket, f"run/checkpoints/{FINAL}", tmp_path / "final")
    assert compare(baseline_two_nodes, final).returncode == 0
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["timings"]["mode"] == "async-store"
    assert {name.split("_")[2] for name in manifest["files"] if name.endswith(".distcp")} == {"0", "1"}
    record = json.loads((tmp_path / "node-0" / "attempts" / sorted(
        (tmp_path / "node-0" / "attempts").iterdir())[-1].name / "attempt.json").read_text())
    [saved] = [entry for entry in record["generations_published"] if entry["name"] == FINAL]
    assert saved["durable_s"] >= saved["upload_s"] > 0 and record["checkpoint_mode"] == "async"
    assert not (tmp_path / "node-1" / "checkpoints" / FINAL).exists()

    # A different world size keeps today's behaviour: refused, or allowed with the override.
    one = ("--output", url, "--local-tier", tmp_path / "single", "--epochs", 3, "--resume")
    refused = run_cli(*one, env=env)
    assert refused.returncode == 65 and "world_size" in one_error_line(refused)
    allowed = run_cli(*one, "--allow-drift", "world_size", env=env)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert f"restored {FINAL}" in allowed.stdout


def test_a_zombie_writer_whose_lease_was_taken_over_cannot_commit(s3_server, s3_bucket, tmp_path):
    """Pause a writer (SIGSTOP) past its lease, start a new attempt, which takes the lease
    over; resume the old one (SIGCONT): its next commit is refused and it exits 73 without
    touching the new attempt's line."""
    bucket = s3_bucket.name
    url, env = f"s3://{bucket}/run", store_env(s3_server)
    common = ["--epochs", 40, "--recover-every-steps", 4, "--lease-ttl-secs", 2]
    zombie = start(url, *common, "--local-tier", tmp_path / "zombie", env=env)
    successor = zombie
    try:
        wait_for_line(zombie, "durable generation step-00000008")
        zombie.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        successor = start(url, *common, "--local-tier", tmp_path / "successor", "--resume", env=env)
        said = []
        for line in successor.stdout:
            said.append(line)
            if line.startswith("durable generation"):
                break
        assert any(line.startswith("took over the lease") for line in said)
        assert time.monotonic() - paused >= 2  # only once the paused holder's lease expired
        restored = int(next(line for line in said if line.startswith("restored ")).split()[1].split("-")[1])
        zombie.send_signal(signal.SIGCONT)
        _, zombie_err = finish(zombie)
        assert zombie.returncode == 73, zombie_err[-2000:]
        assert "lost the lease" in zombie_err and "exiting without touching the newer attempt's line" in zombie_err
        successor.send_signal(signal.SIGTERM)
        finish(successor)
        assert successor.returncode == 75
        # The new line is the successor's alone: every generation after the one it restored.
        attempts_by_start = sorted((tmp_path / "successor" / "attempts").iterdir())
        successor_id = attempts_by_start[-1].name
        later = [name for name in committed(s3_server, bucket) if int(name.split("-")[1]) > restored]
        assert later
        for name in later:
            manifest = json.loads(s3_server.client().get_object(
                Bucket=bucket, Key=f"run/checkpoints/{name}/manifest.json")["Body"].read())
            assert manifest["attempt"] == successor_id, name
    finally:
        for process in (zombie, successor):
            if process.poll() is None:
                process.kill()



def test_one_node_losing_the_store_fails_both_nodes_with_74_and_commits_nothing(s3_server, s3_bucket, tmp_path):
    """Async saves; node 1 reaches no object store (its endpoint is a closed port): its
    background upload fails after the retry bound, every rank learns of it at the next save
    and exits 74 (rank 0 prints one line naming rank 1), and nothing is committed."""
    bucket = s3_bucket.name
    url, env = f"s3://{bucket}/run", store_env(s3_server)
    results = two_nodes(url, tmp_path, "--checkpoint-mode", "async", "--store-retries", 1, "--store-timeout-secs", 2,
                        env=env, per_node={1: {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}})
    assert statuses(results) == [74, 74], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    [line] = [line for line in results[0].stderr.splitlines() if line.startswith("trainer:")]
    assert line.startswith(f"trainer: error: rank 1: {url}: uploading {url}/checkpoints/step-00000008/__1_"), line
    assert "failed after 2 tries" in line and "when the store is back, rerun with --resume auto" in line
    assert not [line for line in results[1].stderr.splitlines() if line.startswith("trainer:")], \
        "rank 0 alone prints the failure every rank shares"
    assert committed(s3_server, bucket) == []
    assert not list((tmp_path / "node-1" / "checkpoints").glob("*")), "node 1's scratch is gone"


def test_a_paused_rank_0_of_two_nodes_is_fenced_after_a_takeover(s3_server, s3_bucket, tmp_path):
    """Async saves on two nodes; rank 0 stops (SIGSTOP) right before committing step-00000008's
    manifest, past its lease. A new single-process attempt takes the lease over and commits its
    own line; once continued, the old rank 0's commit is refused by the fence: both old nodes
    exit 73 and the new line is untouched."""
    bucket = s3_bucket.name
    url, env = f"s3://{bucket}/run", store_env(s3_server)
    port, processes = free_port(), []
    for node in (0, 1):
        command = ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                   "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "trainer", "--output", url,
                   "--local-tier", str(tmp_path / f"node-{node}"), *map(str, EPOCHS), "--checkpoint-mode", "async",
                   "--lease-ttl-secs", "2", "--export-every-epochs", "3",  # the first commit is step-00000008's
                   "--peer-silence-secs", "600"]  # paused, not frozen: rank 1 must not end it (it is the zombie)
        processes.append(launch(command, clean_environment(**env, TRAINER_EXIT_STATUS_FILE=str(tmp_path / f"s-{node}"),
                                                           TRAINER_PAUSE_POINT="store-before-manifest",
                                                           TRAINER_FAULT_RANK="0")))
    successor = None
    try:
        for line in processes[0].stderr:  # torchrun's stderr carries its child's
            if "fault injection: pausing at store-before-manifest" in line:
                break
        successor = start(url, "--epochs", 1, "--local-tier", tmp_path / "successor", "--resume", "auto", env=env)
        _, successor_err = finish(successor)
        assert successor.returncode == 0, successor_err[-2000:]
        assert committed(s3_server, bucket) == ["step-00000008"]  # its own, in place of the zombie's objects
        successor_id = sorted((tmp_path / "successor" / "attempts").iterdir())[-1].name
        trainer_pid = next(int(line.split()[0]) for line in subprocess.run(
            ["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
            if line.split()[1] == str(processes[0].pid))
        os.kill(trainer_pid, signal.SIGCONT)
        outputs = [finish(process) for process in processes]
        old = [int((tmp_path / f"s-{node}").read_text()) for node in (0, 1)]
        assert old == [73, 73], outputs[0][0][-3000:] + outputs[0][1][-3000:] + outputs[1][1][-3000:]
        assert "lost the lease" in outputs[0][1]
        assert committed(s3_server, bucket) == ["step-00000008"]  # the zombie committed nothing
        manifest = json.loads(s3_server.client().get_object(
            Bucket=bucket, Key="run/checkpoints/step-00000008/manifest.json")["Body"].read())
        assert manifest["attempt"] == successor_id
    finally:
        for process in [*processes, successor]:
            if process is not None and process.poll() is None:
                process.kill()


# ----------------------------------------------------------------------------- tier 0 on two nodes
TIER0 = ("--recover-every-steps", 4, "--memory-every-steps", 3, "--log-every-steps", 100)
"""Durable generations at 4, 8, 12 and 16; tier-0 saves at 3, 6, 9 and 15 (12 is durable)."""
TIER0_STEP = "step-00000006"


def part(tmp: Path, node: int, rank: int, name: str = TIER0_STEP, world: int = 2) -> Path:
    """Rank `rank`'s part of a tier-0 generation as node `node` keeps it (its own or a replica)."""
    return memory_dir(tmp, node) / f"rank-{rank}-of-{world}" / "checkpoints" / name


def copy_bucket(server, source: str, tmp: Path) -> str:
    """A new bucket holding every object of `source`: one interrupted run, resumed many ways."""
    client, bucket = server.client(), server.create_bucket()
    for key in keys(server, source, ""):
        client.put_object(Bucket=bucket, Key=key, Body=client.get_object(Bucket=source, Key=key)["Body"].read())
    return bucket


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def tier0_interrupted(s3_server, tmp_path_factory) -> tuple[str, Path]:
    """Two nodes with tier 0, stopped after step 7 without saving (exit 75): the store holds
    step-00000004; each node's tier 0 holds its own rank's part of step-00000006 and the
    replica of the other rank's (step-00000003 was given back: older than the durable step 4)."""
    bucket, tmp = s3_server.create_bucket(), tmp_path_factory.mktemp("tier0-two-nodes")
    results = two_nodes(f"s3://{bucket}/run", tmp, *TIER0, "--interrupt-at-step", 7, env=store_env(s3_server),
                        memory=True, forked=True)  # its launch is not under test
    assert statuses(results) == [75, 75], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert committed(s3_server, bucket) == ["step-00000004"]
    for node in (0, 1):
        assert sorted(p.name for p in memory_dir(tmp, node).iterdir()) == ["rank-0-of-2", "rank-1-of-2"]
        for rank in (0, 1):
            assert sorted(p.name for p in part(tmp, node, rank).parent.iterdir()) == [TIER0_STEP], (node, rank)
    # Each part is its rank's alone: its own RNG entry, no other rank's.
    index = (part(tmp, 1, 1) / "manifest.json").read_text()
    assert "rng_by_rank" in (part(tmp, 1, 1) / ".metadata").read_bytes().decode("latin-1") and index
    return bucket, tmp


@pytest.fixture
def tier0_copy(s3_server, tier0_interrupted, tmp_path) -> tuple[str, Path]:
    """A copy of the interrupted run to resume: its bucket and both nodes' tier 0 (new local
    tiers: the run directory is the store's)."""
    bucket, tmp = tier0_interrupted
    for node in (0, 1):
        shutil.copytree(memory_dir(tmp, node), memory_dir(tmp_path, node))
    return copy_bucket(s3_server, bucket, tmp_path), tmp_path


def resume_tier0(s3_server, bucket: str, tmp: Path, forked: bool = True) -> list[subprocess.CompletedProcess]:
    """The two nodes resumed, their ranks forked (`two_nodes`): which source serves is under test,
    not the launch (torchrun's own: the killed process's resume below, and the ring of three)."""
    results = two_nodes(f"s3://{bucket}/run", tmp, *TIER0, "--resume", env=store_env(s3_server), memory=True,
                        forked=forked)
    assert statuses(results) == [0, 0], results[0].stdout[-3000:] + results[0].stderr[-3000:] + \
        results[1].stderr[-3000:]
    return results


def restored_record(tmp: Path) -> dict:
    folder = sorted((tmp / "node-0" / "attempts").iterdir())[-1]
    return json.loads((folder / "attempt.json").read_text())["restored"]


def assert_exact(s3_server, bucket: str, tmp: Path, baseline: Path) -> None:
    final = download(s3_server, bucket, f"run/checkpoints/{FINAL}", tmp / "final")
    result = compare(baseline, final)
    assert result.returncode == 0 and "all equal" in result.stdout, result.stdout


def test_a_process_killed_after_a_tier0_save_restores_from_each_nodes_tier0(s3_server, s3_bucket, tmp_path,
                                                                               baseline_two_nodes):
    """kill -9 of node 1's process right after its tier-0 save of step 6 (durable: step 4):
    both nodes keep their memory; the resume restores step 6 from each node's own tier 0,
    every part verified, and ends bit-identical to the uninterrupted run."""
    url, env = f"s3://{s3_bucket.name}/run", store_env(s3_server)
    crashed = two_nodes(url, tmp_path, *TIER0, "--memory-every-steps", 6, env=env, memory=True,
                        fault={"TRAINER_FAULT_POINT": "after-memory-save", "TRAINER_FAULT_RANK": "1"})
    assert "fault injection: killing at after-memory-save" in crashed[1].stderr
    assert 0 not in statuses(crashed)
    assert committed(s3_server, s3_bucket.name) == ["step-00000004"]
    assert part(tmp_path, 0, 0).is_dir() and part(tmp_path, 1, 1).is_dir()
    resumed = resume_tier0(s3_server, s3_bucket.name, tmp_path, forked=False)  # under torchrun, as the crash
    assert f"restored {TIER0_STEP} (step=6 epoch=0 position=6) from tier 0 (memory)" in resumed[0].stdout
    restored = restored_record(tmp_path)
    assert restored["tier"] == "memory" and restored["step"] == 6 and "refused" not in restored
    for node in (0, 1):  # completed: every part older than the final generation is given back
        assert not list(memory_dir(tmp_path, node).glob("rank-*/checkpoints/step-*")), node
    assert_exact(s3_server, s3_bucket.name, tmp_path, baseline_two_nodes)


def test_a_lost_node_is_restored_from_its_partners_replica(s3_server, tier0_copy, baseline_two_nodes):
    """Node 1 lost (its processes gone, its memory wiped: a replacement node with an empty
    tier 0): rank 1 fetches its part of step 6 from rank 0, which keeps its replica; rank 0
    uses its own; exact."""
    bucket, tmp = tier0_copy
    shutil.rmtree(memory_dir(tmp, 1))
    resumed = resume_tier0(s3_server, bucket, tmp)
    output = resumed[0].stdout + resumed[0].stderr
    assert f"tier 0 of rank 1 cannot serve {TIER0_STEP} (not in this node's tier 0): fetching the replica" in output
    assert f"restored {TIER0_STEP} (step=6 epoch=0 position=6) from tier 0 and a peer's replica" in output
    restored = restored_record(tmp)
    assert restored["tier"] == "peer" and restored["step"] == 6
    report = run_cli("report", f"s3://{bucket}/run", env=store_env(s3_server))
    assert f"{TIER0_STEP}   from tier 0 and a peer's replica (memory)" in report.stdout, report.stdout + report.stderr
    assert_exact(s3_server, bucket, tmp, baseline_two_nodes)


def test_both_tier0_copies_lost_leave_the_object_store_to_serve(s3_server, tier0_copy, baseline_two_nodes):
    bucket, tmp = tier0_copy
    for node in (0, 1):
        shutil.rmtree(memory_dir(tmp, node))
    resumed = resume_tier0(s3_server, bucket, tmp)
    assert "restored step-00000004 (step=4 epoch=0 position=4) from the object store" in resumed[0].stdout
    assert restored_record(tmp)["tier"] == "store"
    assert_exact(s3_server, bucket, tmp, baseline_two_nodes)


def test_a_damaged_tier0_part_is_refused_by_its_hash_and_the_partners_replica_serves(
        s3_server, tier0_copy, baseline_two_nodes):
    """A flipped byte in rank 1's own part (memory damaged): refused by its digest with one
    warning line, the replica on node 0 serves it; exact."""
    bucket, tmp = tier0_copy
    flip_a_byte(sorted(part(tmp, 1, 1).glob("*.distcp"))[0])
    resumed = resume_tier0(s3_server, bucket, tmp)
    output = resumed[0].stdout + resumed[0].stderr
    warned = [line for line in output.splitlines() if "cannot serve" in line or "refused" in line]
    assert len(warned) == 1 and "rank 1" in warned[0] and "blake3 mismatch" in warned[0], output
    assert restored_record(tmp)["tier"] == "peer"
    assert_exact(s3_server, bucket, tmp, baseline_two_nodes)


def test_a_damaged_part_without_a_replica_leaves_the_object_store_to_serve(s3_server, tier0_copy,
                                                                           baseline_two_nodes):
    """The next source after that: rank 1's part damaged and its replica gone too: tier 0 is
    refused in one line naming the rank and the hash, and the store's step 4 serves; exact."""
    bucket, tmp = tier0_copy
    flip_a_byte(sorted(part(tmp, 1, 1).glob("*.distcp"))[0])
    shutil.rmtree(part(tmp, 0, 1))
    resumed = resume_tier0(s3_server, bucket, tmp)
    output = resumed[0].stdout + resumed[0].stderr
    refused = [line for line in output.splitlines() if "tier 0 refused" in line]
    assert len(refused) == 1 and "rank 1: " in refused[0] and "blake3 mismatch" in refused[0], output
    assert "restoring step-00000004" in refused[0]
    assert "restored step-00000004 (step=4 epoch=0 position=4) from the object store" in resumed[0].stdout
    restored = restored_record(tmp)
    assert restored["tier"] == "store" and restored["refused"][0].startswith(f"memory {TIER0_STEP}: rank 1: ")
    assert_exact(s3_server, bucket, tmp, baseline_two_nodes)


def test_three_nodes_a_lost_node_fetches_from_the_next_node_while_its_own_replica_is_lost_too(tmp_path,
                                                                                             tmp_path_factory):
    """A ring of three nodes (one process each, one shared run directory, async saves): rank r's replica is
    kept by rank r+1, so a node's sender and receiver are different peers. Node 1 lost (memory
    wiped): rank 1 fetches its part from rank 2; the replica of rank 0 that node 1 kept is gone,
    but rank 0's own part serves. Exact against the shared uninterrupted 3-process DDP run of
    test_exact_matrix.py (`torchrun --standalone`, the same 12 steps; support.runs)."""
    three = ("--samples", 144, "--batch-size", 12, "--epochs", 1, *TIER0, "--checkpoint-mode", "async")
    """12 steps, 4 samples per rank per step; async saves: a part is replicated once its
    background commit is reported."""

    def run(folder: Path, *args) -> list[subprocess.CompletedProcess]:
        return two_nodes(str(folder / "run"), folder, *three, *args, env={}, count=3, memory=True)

    interrupted = run(tmp_path, "--interrupt-at-step", 7)
    assert statuses(interrupted) == [75, 75, 75], interrupted[0].stderr[-3000:]
    for node in range(3):  # its own part and its keeper's replica: rank r's on node r and r + 1
        assert sorted(p.name for p in memory_dir(tmp_path, node).iterdir()) == \
            sorted([f"rank-{node}-of-3", f"rank-{(node - 1) % 3}-of-3"])
        assert part(tmp_path, node, node, world=3).is_dir() and part(tmp_path, node, (node - 1) % 3, world=3).is_dir()
    shutil.rmtree(memory_dir(tmp_path, 1))
    resumed = run(tmp_path, "--resume")
    assert statuses(resumed) == [0, 0, 0], resumed[0].stdout[-3000:] + resumed[1].stderr[-3000:]
    output = resumed[0].stdout + resumed[0].stderr
    assert f"tier 0 of rank 1 cannot serve {TIER0_STEP}" in output and "tier 0 of rank 0" not in output
    assert f"restored {TIER0_STEP} (step=6 epoch=0 position=6) from tier 0 and a peer's replica" in output
    final = "step-00000012"
    result = compare(matrix_baseline(tmp_path_factory, 3, "ddp") / "checkpoints" / final,
                     tmp_path / "run" / "checkpoints" / final)
    assert result.returncode == 0 and "all equal" in result.stdout, result.stdout


@pytest.mark.parametrize("node_args, memory, line", [
    ({0: ("--memory-dir", "NODE0")}, False,
     "--memory-dir is given to some ranks but not to rank(s) [1]; give it on every node, or on none"),
    ({1: ("--memory-every-steps", 5)}, True,
     "tier 0: --memory-every-steps differs between nodes (10 on rank 0, 5 on rank 1); give the same on every node"),
], ids=["memory-dir-on-one-node", "memory-every-steps-differs"])
def test_tier0_given_differently_on_two_nodes_is_refused_on_both_in_one_line(tmp_path, node_args, memory, line):
    """--memory-dir on node 0 only, or another --memory-every-steps on node 1: every rank would
    wait for a peer in the replica's rounds; instead both nodes stop at the claim before anything
    is written (their tier 0 neither), exit 2, one line. ~8 s each."""
    node_args = {node: tuple(memory_dir(tmp_path, 0) if arg == "NODE0" else arg for arg in args)
                 for node, args in node_args.items()}
    results = two_nodes(str(tmp_path / "run"), tmp_path, env={}, node_args=node_args, memory=memory)
    assert statuses(results) == [2, 2]
    said = [[line for line in result.stderr.splitlines() if line.startswith("trainer:")] for result in results]
    assert said == [[f"trainer: error: {line}"], []], said  # rank 0 alone says it
    assert "trainer/" not in results[0].stderr  # no traceback of ours (torchrun prints its own)
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())
    assert not any(memory_dir(tmp_path, node).exists() for node in (0, 1))
