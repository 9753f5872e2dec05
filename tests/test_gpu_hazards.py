"""The CUDA and NCCL hazards of issue 56, each shown where its mechanism shows without a GPU
(docs/scale-out.md, On GPUs, says what only a GPU can verify):

- a CUDA query made while the workload is imported is recorded, and refuses the warm spare's fork
  on a CUDA build (a fork after `cudaGetDeviceCount` sees no GPU);
- a silent peer on a non-gloo backend aborts the backend's communicator (an in-memory
  communicator of our own interface), gloo still only cuts sockets, and a collective that
  returns after the waits were ended never goes on;
- each process's CUDA device from what it sees (one visible device per rank: cuda:0);
- the process group's backend: NCCL on CUDA, gloo on the CPU, gloo on CUDA when asked for (several
  processes on one GPU: bench/gpu_check.sh's restart) and fingerprinted then; NCCL without CUDA refused;
- a restore onto a device loads into host buffers and waits once per device;
- the replica's rounds: a newer part supersedes a queued older one, so at most two are owed;
- an op without a deterministic implementation: one line naming it and the opt-in (exit 2),
  through the trainer and through the library; with the opt-in the run completes, recorded as
  not promised exact.

Cost: the unit tests well under 1 CPU-s together; the trainer and library runs a few seconds each.
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
import threading

import pytest
import torch

from support.cli import REPO, one_error_line, run_cli
from support.runs import attempts
from trainer.checkpoint.device_copy import DeviceCopies
from trainer.errors import PeerFailure
from trainer.parallel.cuda_fork import SCRIPT, CudaQueries, CudaState, driver_mapped, fork_refusal
from trainer.parallel.launch import LaunchEnvironment
from trainer.parallel.ranks import Ranks, backend_for, device_of_rank
from trainer.run.fingerprint import device_kind
from trainer.parallel.silence import waits_of
from trainer.storage.memory.replication import Rounds, say_interface


# ----------------------------------------------------------------------------- 1: the spare and CUDA
def test_a_cuda_query_while_the_workload_imports_is_recorded_and_refuses_the_fork(tmp_path, monkeypatch):
    (tmp_path / "asks_cuda_at_import.py").write_text("import torch\nDEVICE = 'cuda' if torch.cuda.is_available() "
                                                     "else 'cpu'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    original = torch.cuda.is_available
    queries = CudaQueries().watch()
    try:
        importlib.import_module("asks_cuda_at_import")
        torch.cuda.is_bf16_supported()  # torch's own call of is_available goes through the watch too
    finally:
        queries.stop()
    assert torch.cuda.is_available is original
    assert queries.seen == ["torch.cuda.is_available()"]
    state = CudaState.of_this_process(queries)
    refusal = fork_refusal(CudaState(True, False, state.queried, False))  # as on a CUDA build
    assert refusal and "torch.cuda.is_available() was called while the workload was imported" in refusal
    said = fork_refusal(CudaState(True, False, state.queried, False), SCRIPT)  # a user's script's spare (trainer/launch.py)
    assert "while the script's imports were imported" in said and "the script's own code" in said
    assert fork_refusal(CudaState(True, False, (), False)) is None
    assert fork_refusal(CudaState(False, False, state.queried, False)) is None  # a CPU build: nothing to poison
    assert "initialised" in fork_refusal(CudaState(True, True, (), False))
    assert "libcuda" in fork_refusal(CudaState(True, False, (), True))


def test_the_cuda_driver_is_found_mapped_into_the_process():
    assert driver_mapped("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    assert not driver_mapped("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libcudart.so.12\n7f02-7f03 r--p 0 0 0 [heap]\n")
    assert not driver_mapped()  # this CPU-only test machine


# ----------------------------------------------------------------------------- 2: a frozen NCCL peer
class Communicator:
    def __init__(self, fails: bool = False):
        self.aborted, self.fails = 0, fails

    def abort(self) -> None:
        self.aborted += 1
        if self.fails:
            raise RuntimeError("abort failed")


class Sockets:
    def __init__(self):
        self.cuts = 0

    def cut(self) -> int:
        self.cuts += 1
        return 2


def test_a_silent_peer_aborts_the_communicator_of_a_backend_that_is_not_gloo():
    sockets, communicator = Sockets(), Communicator()
    assert waits_of("nccl", sockets, communicator).cut() == 3  # the background gloo groups' sockets too
    assert (communicator.aborted, sockets.cuts) == (1, 1)
    sockets, communicator = Sockets(), Communicator()
    assert waits_of("gloo", sockets, communicator).cut() == 2
    assert (communicator.aborted, sockets.cuts) == (0, 1)
    failing = Communicator(fails=True)  # a failed abort leaves the group's timeout as the way out
    assert waits_of("nccl", Sockets(), failing).cut() == 2 and failing.aborted == 1


class Judged:
    """A heartbeat that found rank 1 silent (its verdict reached)."""

    verdict = {"ranks": [1], "silent_s": 4.0, "ended": []}

    def silent_ranks(self) -> list[int]:
        return [1]


def test_a_collective_that_returns_after_the_waits_were_ended_fails_naming_the_silent_rank():
    ranks = Ranks(LaunchEnvironment(rank=0, world_size=2), torch.device("cpu"), heartbeat=Judged())
    with pytest.raises(PeerFailure) as failed:
        with ranks._collective("agreeing on the step outcome"):
            pass  # an aborted NCCL collective may return without an error
    assert "rank 1 stopped answering" in str(failed.value) and failed.value.ranks == (1,)


# ----------------------------------------------------------------------------- 5: device indices
@pytest.mark.parametrize("local_rank, visible, index", [(1, 1, 0), (3, 8, 3), (5, 4, 1), (0, 1, 0)])
def test_each_process_uses_a_device_it_can_see(local_rank, visible, index):
    assert device_of_rank(torch.device("cuda"), local_rank, visible) == torch.device("cuda", index)


@pytest.mark.parametrize("device, asked, backend", [("cpu", "auto", "gloo"), ("cuda", "auto", "nccl"),
                                                    ("cuda", "gloo", "gloo"), ("cpu", "gloo", "gloo")])
def test_the_process_groups_backend_follows_the_device_unless_asked(device, asked, backend):
    assert backend_for(torch.device(device), asked) == backend


def test_nccl_without_cuda_is_refused_in_one_line_naming_both_ways_out(tmp_path):
    result = run_cli("--output", tmp_path / "run", "--device", "cpu", "--data-parallel-backend", "nccl")
    assert result.returncode == 2
    line = one_error_line(result)
    assert "--data-parallel-backend nccl needs CUDA" in line and "--data-parallel-backend gloo" in line
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_backend_other_than_the_devices_own_is_part_of_the_fingerprints_device():
    assert device_kind(torch.device("cpu"), "gloo") == device_kind(torch.device("cpu")) == "cpu"
    assert device_kind(torch.device("cpu"), None) == "cpu"
    assert device_kind(torch.device("cpu"), "mpi") == "cpu over mpi"


def test_a_device_the_launch_named_is_kept():
    assert device_of_rank(torch.device("cuda", 2), 1, 8) == torch.device("cuda", 2)


# ----------------------------------------------------------------------------- 6: restores onto a device
def test_a_restore_onto_a_device_loads_into_host_buffers_and_waits_once_per_device():
    weight, bias = torch.nn.Parameter(torch.empty(3, device="meta")), torch.empty(2, device="meta")  # as CUDA's
    host_only = torch.zeros(2)
    waited = []
    copies = DeviceCopies({"model": {"w": weight, "b": bias, "cpu": host_only}, "rng": [weight, 7]}, waited.append)
    loaded = copies.template
    assert [tensor.device.type for tensor in (loaded["model"]["w"], loaded["model"]["b"], loaded["rng"][0])] == \
        ["cpu"] * 3
    assert loaded["model"]["cpu"] is host_only and len(copies.copies) == 3
    handed = copies.copy_back()
    assert handed["model"]["w"] is weight and handed["model"]["b"] is bias and handed["rng"] == [weight, 7]
    assert waited == [torch.device("meta")] and copies.waits == 1
    nothing = DeviceCopies({"w": torch.zeros(1)}, waited.append)  # a CPU run: no plan, no wait
    assert nothing.copies == [] and nothing.copy_back()["w"].device.type == "cpu" and len(waited) == 1


# ----------------------------------------------------------------------------- 7: the replica's rounds
def test_a_newer_round_supersedes_queued_older_ones_so_at_most_two_parts_are_owed():
    rounds = Rounds()
    moving = rounds.offer(True)
    assert rounds.sends(moving)  # begins at once: nothing newer
    queued = [rounds.offer(True) for _ in range(50)]  # a slow link: fifty saves while it moves
    skipped = rounds.offer(False)  # a save point with nothing to send
    sent = [number for number in queued if rounds.sends(number)]
    assert sent == [queued[-1]] and rounds.sends(skipped)
    assert rounds.offered == 52  # every round still meets its partner's


def test_the_replicas_interface_is_said_with_how_it_was_chosen():
    assert "from 10.0.0.5 (GLOO_SOCKET_IFNAME=ib0)" in say_interface(["10.0.0.5"], {"GLOO_SOCKET_IFNAME": "ib0"})
    assert "set GLOO_SOCKET_IFNAME" in say_interface(["192.168.1.2"], {})


# ----------------------------------------------------------------------------- 4: determinism
NONDETERMINISTIC = ("--workload", "tests/workloads/nondeterministic.py:Nondeterministic", "--epochs", 1,
                    "--batch-size", 8)


def test_an_op_without_a_deterministic_kernel_ends_the_run_in_one_line_naming_it_and_the_opt_in(tmp_path):
    refused = run_cli("--output", tmp_path / "run", *NONDETERMINISTIC)
    line = one_error_line(refused)
    assert refused.returncode == 2, line
    assert line.startswith("trainer: error: put_ has no deterministic implementation on this device") and \
        "--allow-nondeterministic-ops" in line, line
    allowed = run_cli("--output", tmp_path / "allowed", *NONDETERMINISTIC, "--allow-nondeterministic-ops")
    assert allowed.returncode == 0, allowed.stderr
    exactness = attempts(tmp_path / "allowed")[-1]["exactness"]
    assert exactness["exact"] is False and "--allow-nondeterministic-ops" in exactness["reason"]


LIBRARY_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from trainer import recovery

    recovery.seed_everything(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"allow_nondeterministic_ops": True} if sys.argv[2:] == ["allow"] else {}
    with recovery.open_run(sys.argv[1], **options) as run:
        run.restore(model, optimizer)
        for _ in range(2):
            loss = model(torch.ones(2, 4)).sum()
            torch.zeros(4).put_(torch.tensor([0, 1]), torch.tensor([1.0, 2.0]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
""")


def test_the_library_refuses_the_op_in_the_same_line_with_its_keyword(tmp_path):
    script = tmp_path / "own_loop_put.py"
    script.write_text(LIBRARY_SCRIPT)
    refused = run_cli(script, tmp_path / "run")
    assert refused.returncode == 2, refused.stderr
    said = [line for line in refused.stderr.splitlines() if "has no deterministic implementation" in line]
    assert said and "put_" in said[0] and "allow_nondeterministic_ops=True" in said[0], refused.stderr
    assert "Traceback" not in refused.stderr
    allowed = run_cli(script, tmp_path / "allowed", "allow")
    assert allowed.returncode == 0, allowed.stderr
    assert attempts(tmp_path / "allowed")[-1]["exactness"]["exact"] is False
