"""Async recovery writes: equal state to sync, isolated staging, failures surfaced, one save
in flight, and a drained save on every way out. In-process tests use real DCP and a real
LocalSection; only the storage writer is wrapped (gated or failing) where timing matters."""

from __future__ import annotations

import errno
import json
import resource
import signal
import threading

import pytest
import torch

from support.cli import compare, one_error_line, run_cli, train
from support.limits import scaled
from support.runs import attempts, generation
from trainer.config import WorkloadConfig
from trainer.errors import StorageFailure, root_cause
from trainer.checkpoint.atomic import file_digest
from trainer.checkpoint.checkpointer import AsyncCheckpointer, SyncCheckpointer, effective_mode
from trainer.checkpoint.commit import RenameCommit
from trainer.checkpoint.manifest import GenerationFacts, verify_directory
from trainer.checkpoint.snapshot import load_flat
from trainer.checkpoint.section import LocalSection
from trainer.checkpoint.writer import HashingFileSystemWriter
from trainer.run.state import TrainingState
from trainer.workload import build_workload

CPU = torch.device("cpu")
# DCP says it assumes one process when no process group exists: that is the intent here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ----------------------------------------------------------------------------- helpers
class GatedWriter(HashingFileSystemWriter):
    """Holds every write until `gate` is set; counts writes running at the same time."""

    def __init__(self, path, gate: threading.Event, tracker: dict):
        super().__init__(path)
        self.gate, self.tracker = gate, tracker

    def write_data(self, plan, planner):
        with self.tracker["lock"]:
            self.tracker["running"] += 1
            self.tracker["peak"] = max(self.tracker["peak"], self.tracker["running"])
        try:
            assert self.gate.wait(scaled(300)), "test gate never opened"
            return super().write_data(plan, planner)
        finally:
            with self.tracker["lock"]:
                self.tracker["running"] -= 1


class DiskFullWriter(HashingFileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))


def small_state(hidden: int = 64) -> TrainingState:
    workload = build_workload(WorkloadConfig(options=(("hidden_size", hidden),)))
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    state = TrainingState(model, optimizer, workload.build_scheduler(optimizer),
                          torch.amp.GradScaler("cpu", enabled=False))
    loss = model(torch.randn(8, workload.workload.config.features)).square().mean()
    loss.backward()
    optimizer.step()  # creates the momentum buffers
    return state


def facts(step: int) -> GenerationFacts:
    return GenerationFacts(step=step, epoch=0, position=step, fingerprint={}, allowed_drift=(), cadence={},
                           created_utc="test")


class WithWriter(AsyncCheckpointer):
    """An AsyncCheckpointer whose DCP writer is `make_writer(path)`."""

    def __init__(self, store, make_writer):
        super().__init__(RenameCommit(store), "test", CPU)
        self.make_writer = make_writer

    def new_writer(self, directory):
        return self.make_writer(directory)


def gated_checkpointer(tmp_path, gate: threading.Event, tracker: dict | None = None):
    tracker = tracker if tracker is not None else {"lock": threading.Lock(), "running": 0, "peak": 0}
    store = LocalSection(tmp_path / "checkpoints")
    return store, WithWriter(store, lambda path: GatedWriter(path, gate, tracker))


def live_tensors(state: TrainingState) -> dict[str, torch.Tensor]:
    tensors = {f"model.{k}": v for k, v in state.model.state_dict().items()}
    params = dict(state.model.named_parameters())
    for name, param in params.items():
        for key, value in state.optimizer.state[param].items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.state.{name}.{key}"] = value
    return tensors


# ----------------------------------------------------------------------------- end to end
def test_async_interrupted_and_resumed_matches_sync_baseline(tmp_path, baseline):
    run = tmp_path / "run"
    train(run, "--checkpoint-mode", "async", "--interrupt-at-step", 27, expect=75)
    resumed = train(run, "--checkpoint-mode", "async", "--resume")
    assert "restored step-00000024" in resumed.stdout
    result = compare(generation(baseline), generation(run))
    assert result.returncode == 0, result.stdout
    assert attempts(baseline)[0]["checkpoint_mode"] == "sync"  # auto on CPU
    records = attempts(run)
    assert [r["checkpoint_mode"] for r in records] == ["async", "async"]
    # Interrupted after step 27 without saving: the step-24 save (possibly still in flight
    # when the interrupt came) was drained, published and recorded before exit 75.
    assert records[0]["generations_published"][-1]["name"] == "step-00000024"
    sealed = json.loads((generation(run) / "manifest.json").read_text())
    assert sealed["timings"]["mode"] == "async"
    assert verify_directory(generation(run)).ok


def test_background_disk_failure_exits_74_and_is_recorded(tmp_path):
    """A real storage error in the background writer thread (file-size limit → EFBIG)."""
    run = tmp_path / "run"

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    result = run_cli("--output", run, "--checkpoint-mode", "async", "--hidden-size", 512, "--epochs", 2,
                     preexec_fn=limit_file_size)
    assert result.returncode == 74, result.stderr
    line = one_error_line(result)
    assert "writing generation step-00000008 failed: File too large" in line
    record = attempts(run)[0]
    assert (record["status"], record["exit_code"], record["checkpoint_mode"]) == ("failed", 74, "async")
    assert "step-00000008" in record["reason"]
    assert not list((run / "checkpoints").iterdir())  # no generation, no temporary left


# ----------------------------------------------------------------------------- in process
def test_staging_isolation_mutations_after_wait_are_not_written(tmp_path):
    state = small_state()
    gate = threading.Event()
    store, checkpointer = gated_checkpointer(tmp_path, gate)
    expected = {k: v.detach().clone() for k, v in live_tensors(state).items()}

    checkpointer.save(state.state_dict(), facts(1))
    checkpointer.wait_for_staging()
    with torch.no_grad():
        for tensor in live_tensors(state).values():
            tensor.add_(1000.0)
    gate.set()  # the write starts only now, after every mutation
    [published] = checkpointer.finalize()

    stored = load_flat(store.path(published.name))
    assert len(expected) >= 6
    for key, before in expected.items():
        assert torch.equal(stored[key].view(torch.uint8), before.view(torch.uint8)), key
        assert not torch.equal(stored[key], live_tensors(state)[key]), f"{key} was not mutated"


@pytest.mark.parametrize("surfaced_by", ["save", "wait_for_staging", "finalize"])
def test_background_failure_is_raised_at_the_next_call(tmp_path, surfaced_by):
    store = LocalSection(tmp_path / "checkpoints")
    checkpointer = WithWriter(store, DiskFullWriter)
    state = small_state()
    assert checkpointer.save(state.state_dict(), facts(1)) == []
    with pytest.raises(StorageFailure, match="writing generation step-00000001 failed: No space left") as raised:
        if surfaced_by == "save":
            checkpointer.save(state.state_dict(), facts(2))
        elif surfaced_by == "wait_for_staging":
            while not checkpointer._in_flight[-1].committed.done():
                threading.Event().wait(0.01)
            checkpointer.wait_for_staging()
        else:
            checkpointer.finalize()
    assert raised.value.exit_code == 74
    assert store.names() == [] and store.temporaries() == []
    assert checkpointer.finalize() == []  # reported once, then drained


def test_at_most_one_save_in_flight(tmp_path):
    gate = threading.Event()
    tracker = {"lock": threading.Lock(), "running": 0, "peak": 0}
    store, checkpointer = gated_checkpointer(tmp_path, gate, tracker)
    state = small_state()
    assert checkpointer.save(state.state_dict(), facts(1)) == []
    second: list = []
    saver = threading.Thread(target=lambda: second.append(checkpointer.save(state.state_dict(), facts(2))))
    saver.start()
    saver.join(0.5)
    assert saver.is_alive(), "a second save started while the first was still writing"
    assert store.names() == []
    gate.set()
    saver.join(30)
    assert [p.name for p in second[0]] == ["step-00000001"]  # published before save 2 began
    assert [p.name for p in checkpointer.finalize()] == ["step-00000002"]
    assert tracker["peak"] == 1
    assert store.names() == ["step-00000001", "step-00000002"]


def test_finalize_drains_and_publishes_the_save_in_flight(tmp_path):
    gate = threading.Event()
    store, checkpointer = gated_checkpointer(tmp_path, gate)
    checkpointer.save(small_state().state_dict(), facts(3))
    assert store.names() == [] and len(store.temporaries()) == 1
    threading.Timer(0.2, gate.set).start()
    [published] = checkpointer.finalize()
    assert published.name == "step-00000003" and store.names() == ["step-00000003"]
    assert store.temporaries() == [] and verify_directory(store.path("step-00000003")).ok


def test_sync_and_async_publish_the_same_state_and_verified_digests(tmp_path):
    state = small_state(hidden=256)
    sync_store = LocalSection(tmp_path / "sync")
    [sync] = SyncCheckpointer(RenameCommit(sync_store), "test").save(state.state_dict(), facts(5))
    async_store = LocalSection(tmp_path / "async")
    checkpointer = AsyncCheckpointer(RenameCommit(async_store), "test", CPU)
    checkpointer.save(state.state_dict(), facts(5))
    [async_] = checkpointer.finalize()
    a, b = load_flat(sync_store.path(sync.name)), load_flat(async_store.path(async_.name))
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key
        else:
            assert repr(a[key]) == repr(b[key]), key
    for store, name in ((sync_store, sync.name), (async_store, async_.name)):
        sealed = json.loads((store.path(name) / "manifest.json").read_text())
        assert len(sealed["files"]) >= 3  # .metadata + shards written by several threads
        for file, recorded in sealed["files"].items():  # hashed while writing == hashed now
            assert file_digest(store.path(name) / file) == recorded, file


def test_auto_mode_is_async_on_cuda_and_sync_on_cpu():
    assert effective_mode("auto", torch.device("cpu")) == "sync"
    assert effective_mode("auto", torch.device("cuda", 0)) == "async"
    assert effective_mode("async", torch.device("cpu")) == "async"
    assert effective_mode("sync", torch.device("cuda", 0)) == "sync"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_reuses_pinned_buffers(tmp_path):
    from trainer.checkpoint.staging import ReusableStager

    stager = ReusableStager(torch.device("cuda", 0))
    source = {"w": torch.randn(1024, 1024, device="cuda"), "step": 3}
    first = stager.stage(source).result()
    source["w"].add_(1)
    second = stager.stage(source).result()
    assert first["w"].is_pinned() and second["w"].data_ptr() == first["w"].data_ptr()
    assert torch.equal(second["w"], source["w"].cpu())
    stager.close()


class HeldCommit(RenameCommit):
    """A rename commit that holds every commit until `gate` is set (an upload to a slow store),
    allowing `max_pending` commits in flight as an object store's commit does."""

    def __init__(self, local, gate: threading.Event, max_pending: int):
        super().__init__(local)
        self.gate, self.max_pending = gate, max_pending

    def commit(self, *args):
        assert self.gate.wait(scaled(300)), "test gate never opened"
        return super().commit(*args)


def test_async_saves_wait_only_once_max_pending_commits_are_in_flight(tmp_path):
    """Two commits may be outstanding (--max-pending-uploads 2): the first two saves return at
    once, the third waits for the oldest commit; all three commit in order."""
    gate = threading.Event()
    store = LocalSection(tmp_path / "checkpoints")
    checkpointer = AsyncCheckpointer(HeldCommit(store, gate, max_pending=2), "test", CPU)
    state = small_state()
    assert checkpointer.save(state.state_dict(), facts(1)) == []
    checkpointer.wait_for_staging()
    assert checkpointer.save(state.state_dict(), facts(2)) == []  # the write of 1 is done; its commit is not
    third: list = []
    saver = threading.Thread(target=lambda: third.append(checkpointer.save(state.state_dict(), facts(3))))
    saver.start()
    saver.join(0.5)
    assert saver.is_alive(), "the third save must wait while two commits are outstanding"
    gate.set()
    saver.join(scaled(60))
    assert third[0] and third[0][0].name == "step-00000001"  # 2 as well, if it committed meanwhile
    rest = checkpointer.finalize()
    assert [published.name for published in third[0] + rest] == ["step-00000001", "step-00000002", "step-00000003"]
    assert store.names() == ["step-00000001", "step-00000002", "step-00000003"]


def test_root_cause_stops_where_the_chain_of_errors_loops():
    """An inner error re-raised while its wrapper is handled gets the wrapper as its context:
    the chain loops, and digging for the root cause must still end (with the inner OSError)."""
    inner = OSError(errno.EFBIG, "File too large")
    wrapper = RuntimeError("rank 1 failed")
    wrapper.__cause__, inner.__context__ = inner, wrapper
    assert root_cause(wrapper) is inner and root_cause(inner) is inner
    looped = ValueError("no OSError anywhere")
    other = KeyError("other")
    looped.__context__, other.__context__ = other, looped
    assert root_cause(looped) is other


def test_a_short_write_of_torchs_zip_writer_is_a_storage_failure():
    """torch.save into a shard file that a file-size limit cut short raises a RuntimeError
    ("unexpected pos"), not an OSError: it is still the storage's problem, exit 74."""
    from trainer.errors import as_storage_failure
    cut = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    failure = as_storage_failure(cut, "writing generation step-00000008")
    assert failure is not None and failure.exit_code == 74
    assert str(failure).startswith("writing generation step-00000008 failed: a write was cut short")
    assert as_storage_failure(RuntimeError("some other bug"), "writing") is None
