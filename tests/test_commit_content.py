"""Commits check content, not sizes: a file that holds other bytes than its rank wrote, of the
same size (a zombie rank's late upload), is never committed, on one disk or in an object store.

End to end under real torchrun (2 processes, gloo, 1 epoch): rank 0 stops itself (SIGSTOP, a
pause seam) after every rank wrote its shards and before it checks them; the test, standing in
for a zombie rank of an earlier attempt, replaces rank 1's shard with other bytes of the same
size; rank 0 continues and must refuse the commit: every rank exits 74, rank 0 prints one line
naming the file and rank 1, and no generation exists. Cost: about 10 s of CPU per backend (20-30 s of
wall time on the shared 2 cores; the store case uses the session's SeaweedFS).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import finish
from support.limits import scaled
from support.s3 import committed, keys, store_env
from support.torchrun import clean_environment, launch
from trainer.checkpoint.content import ContentMismatch, check_content, checking, writers_of

GENERATION = "step-00000008"  # the first save of a 2-process run of one epoch


# ----------------------------------------------------------------------------- the pure check
def test_a_same_size_file_with_other_bytes_is_refused_naming_its_rank():
    written = {"__0_0.distcp": {"bytes": 4, "sha256": "a" * 64}, "__1_0.distcp": {"bytes": 4, "sha256": "b" * 64}}
    writers = writers_of([{"__0_0.distcp": written["__0_0.distcp"]}, {"__1_0.distcp": written["__1_0.distcp"]}])
    check_content(written, dict(written), "s3://b/run/checkpoints/step-1", writers, "step-1")  # the same bytes
    with pytest.raises(ContentMismatch) as refused:
        check_content(written, {**written, "__1_0.distcp": {"bytes": 4, "sha256": "c" * 64}}, "WHERE", writers,
                      "step-1")
    assert str(refused.value).startswith("WHERE/__1_0.distcp holds other bytes than rank 1 wrote (sha256 cccc")
    assert refused.value.exit_code == 74 and "step-1 was not committed" in str(refused.value)
    with pytest.raises(ContentMismatch, match="__0_0.distcp is missing"):
        check_content(written, {"__1_0.distcp": written["__1_0.distcp"]}, "WHERE", writers, "step-1")
    described = checking(lambda files: sorted(files), [written], "WHERE", "step-1")
    assert described(dict(written)) == sorted(written)  # a manifest is made only for matching files


# ----------------------------------------------------------------------------- end to end
def stopped_child(launcher: subprocess.Popen, timeout: float = 300) -> int:
    """The pid of the launcher's child that stopped itself (state T), waiting for it (scaled)."""
    deadline = time.monotonic() + scaled(timeout)
    parent = launcher.pid
    while time.monotonic() < deadline and launcher.poll() is None:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                pid, rest = stat.read_text().split(" (", 1)
            except OSError:
                continue
            state, ppid = rest.rsplit(") ", 1)[1].split()[:2]
            if int(ppid) == parent and state == "T":
                return int(pid)
        time.sleep(0.05)
    raise AssertionError(f"no rank reached its pause point: {launcher.stderr.read()[-3000:] if launcher.stderr else ''}")


def flipped(data: bytes) -> bytes:
    """Other bytes of the same size."""
    return bytes(byte ^ 0xFF for byte in data)


def replace_on_disk(run: Path) -> str:
    [shard] = sorted(run.glob(f"checkpoints/.{GENERATION}.tmp-*/__1_*.distcp"))[:1]
    shard.write_bytes(flipped(shard.read_bytes()))
    return shard.name


def replace_in_store(server, bucket: str) -> str:
    [key] = keys(server, bucket, f"run/checkpoints/{GENERATION}/__1_")[:1]
    client = server.client()
    client.put_object(Bucket=bucket, Key=key, Body=flipped(client.get_object(Bucket=bucket, Key=key)["Body"].read()))
    return key.rsplit("/", 1)[1]


@pytest.mark.parametrize("backend", ["disk", "store"])
def test_a_zombies_same_size_late_write_is_never_committed(backend, tmp_path, request):
    if backend == "store":
        bucket = request.getfixturevalue("s3_bucket")
        output, env = f"s3://{bucket.name}/run", {**store_env(bucket.server), "TRAINER_PAUSE_POINT": "store-before-manifest"}
        extra = ("--local-tier", tmp_path / "tier")
    else:
        output, env, extra = tmp_path / "run", {"TRAINER_PAUSE_POINT": "before-seal"}, ()
    status = tmp_path / "status"
    command = ["--standalone", "--nproc_per_node", "2", "-m", "trainer", "--output", str(output),
               "--threads", "1", "--epochs", "1", *map(str, extra),
               "--peer-silence-secs", "600"]  # the seam's pause stands in for a zombie, not a frozen rank to end
    process = launch(command, clean_environment(TRAINER_EXIT_STATUS_FILE=str(status), TRAINER_FAULT_RANK="0", **env))
    try:
        rank_0 = stopped_child(process)
        # The zombie's late write: same size, other bytes, after rank 1 wrote (it waits for rank 0).
        file = replace_in_store(bucket.server, bucket.name) if backend == "store" else replace_on_disk(output)
        os.kill(rank_0, signal.SIGCONT)
        _, err = finish(process, timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert int(status.read_text()) == 74, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("trainer:") and "fault injection" not in line]
    assert len(lines) == 1, err[-3000:]  # rank 0's line, alone
    line = lines[0]
    assert f"/{file} holds other bytes than rank 1 wrote" in line, line
    assert f"{GENERATION} was not committed" in line
    if backend == "store":
        assert line.startswith(f"trainer: error: s3://{bucket.name}/run/checkpoints/{GENERATION}/{file}"), line
        assert committed(bucket.server, bucket.name) == []
    else:
        assert not (output / "checkpoints" / GENERATION).exists()
        assert not list((output / "checkpoints").glob(f".{GENERATION}.tmp-*")), "the refused temporary is gone"
