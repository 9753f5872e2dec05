"""The async stager (trainer/checkpoint/staging.py) and where the loop waits for it
(trainer/run/saving.py `StepGuard`), on CPU: the CUDA path through a fake `DeviceCopies` whose
"devices" are named, so what is queued, fenced and pinned where shows without a GPU."""

from __future__ import annotations

import threading

import torch

from trainer.checkpoint.staging import ReusableStager
from trainer.run.saving import StepGuard, wrapped

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


class FakeEvent:
    def __init__(self, device, log):
        self.device, self.log = device, log

    def synchronize(self):
        self.log.append(("synchronize", self.device))


class FakeCopies:
    """`DeviceCopies` with tensors in host memory said to live on the devices `placed` names
    (by storage); copies are made at once, and every call is logged with its thread."""

    def __init__(self, placed: dict):
        self.placed, self.log = placed, []

    def device_of(self, tensor):
        return self.placed.get(tensor.untyped_storage().data_ptr(), tensor.device)

    def ready(self, device):
        self.log.append(("ready", device, threading.current_thread().name))
        return FakeEvent(device, self.log)

    def queue(self, device, pairs, after):
        assert after.device == device  # after the work queued on that same device
        for source, target in pairs:
            assert self.device_of(source) == device, "a copy queued on another tensor's device"
            target.copy_(source)
        self.log.append(("queue", device, len(pairs)))
        return FakeEvent(device, self.log)

    def fence(self, device, event):
        assert event.device == device, "a device fenced on another device's event"
        self.log.append(("fence", device))

    def pin(self, buffer):
        self.log.append(("pin", buffer.numel() * buffer.element_size(), threading.current_thread().name))
        return True

    def unpin(self, buffer):
        self.log.append(("unpin", buffer.numel() * buffer.element_size()))


def on_devices(**tensors):
    placed = {tensor.untyped_storage().data_ptr(): device for tensor, device in tensors.values()}
    return {name: tensor for name, (tensor, _) in tensors.items()}, FakeCopies(placed)


def test_each_tensors_copy_ends_in_an_event_on_its_own_device():
    """Issue 56 point 5: a model on cuda:1 in a run whose device is cuda:0 is staged complete
    only once cuda:1's copies landed, and each device's next work waits for its own event."""
    state, copies = on_devices(a=(torch.ones(3), CUDA0), b=(torch.full((5,), 2.0), CUDA1), c=(torch.zeros(2), CUDA1))
    stager = ReusableStager(CUDA0, copies=lambda: copies)
    stager.defer(state.values())
    staged = stager.stage(state).result()
    assert all(torch.equal(staged[name], state[name]) for name in state)
    stager.fence()
    state["a"].add_(1)  # the optimizer step, after the fence: the next step's fence finds nothing torn
    stager.fence()
    assert stager.torn is None
    assert {("queue", CUDA0, 1), ("queue", CUDA1, 2)} <= set(copies.log)
    assert {entry for entry in copies.log if entry[0] in ("synchronize", "fence")} == {
        ("synchronize", CUDA0), ("synchronize", CUDA1), ("fence", CUDA0), ("fence", CUDA1)}
    stager.close()


def test_buffers_are_sized_to_the_state_pinned_on_the_stagers_thread_and_unpinned_at_close():
    """Issue 55 point 6, pinned buffers: exactly each tensor's bytes (no power-of-two pool),
    pinned beside the loop, given back when the stager closes."""
    state, copies = on_devices(w=(torch.ones(3, 5), CUDA0), m=(torch.ones(7), CUDA0))
    stager = ReusableStager(CUDA0, copies=lambda: copies)
    stager.defer(state.values())
    stager.stage(state).result()
    pins = [entry for entry in copies.log if entry[0] == "pin"]
    assert sorted(size for _, size, _ in pins) == [28, 60] and stager.buffer_bytes == 88
    assert {thread for *_, thread in pins} == {"recovery-staging_0"}
    stager.stage(state).result()  # reused: nothing pinned again
    assert len([entry for entry in copies.log if entry[0] == "pin"]) == 2
    stager.close()
    assert sorted(entry[1] for entry in copies.log if entry[0] == "unpin") == [28, 60]


def test_what_the_forward_may_change_is_copied_before_stage_returns_the_rest_before_the_step():
    """Deferred (parameters, optimizer state): copied beside the loop, safe once `fence()`
    returned. Not deferred (a buffer a forward updates, an EMA): copied before `stage()`
    returns, so the loop may change it right away."""
    weight, running_mean = torch.arange(1 << 20, dtype=torch.float32), torch.zeros(4)
    stager = ReusableStager(torch.device("cpu"))
    stager.defer([weight])
    future = stager.stage({"weight": weight, "running_mean": running_mean, "step": 7})
    running_mean.add_(1)  # the next forward, at once
    stager.fence()
    weight.add_(1)  # the optimizer step, after its fence
    staged = future.result()
    assert torch.equal(staged["running_mean"], torch.zeros(4)) and staged["step"] == 7
    assert torch.equal(staged["weight"], torch.arange(1 << 20, dtype=torch.float32))
    stager.close()


def test_under_ddp_each_replica_is_staged_by_one_rank_and_every_one_by_some_rank():
    """Issue 55 point 6, staging under DDP: the replicas (parameters, optimizer state) held in
    dicts are shared out over the ranks by size, the same way on every rank; what is not a
    replica (a buffer, this rank's RNG) and a replica in a list stay on every rank."""
    weights = {f"layer{i}": torch.full((size,), float(i)) for i, size in enumerate((64, 8, 32, 32, 8, 4))}
    in_list = torch.ones(16)
    state = {"model": weights, "listed": [in_list], "buffer": torch.zeros(2), "step": 3}
    staged = []
    for rank in range(2):
        stager = ReusableStager(torch.device("cpu"))
        stager.defer([*weights.values(), in_list], share=(rank, 2))
        staged.append(stager.stage(state).result())
        stager.close()
    mine = [set(copy["model"]) for copy in staged]
    assert mine[0] and mine[1] and not mine[0] & mine[1] and mine[0] | mine[1] == set(weights)
    sizes = [sum(weights[key].numel() for key in keys) for keys in mine]
    assert abs(sizes[0] - sizes[1]) <= 8, sizes  # balanced, as DCP's dedup balances
    for copy in staged:
        assert torch.equal(copy["listed"][0], in_list) and torch.equal(copy["buffer"], torch.zeros(2))
        assert copy["step"] == 3 and all(torch.equal(copy["model"][key], weights[key]) for key in copy["model"])


def test_without_defer_every_copy_is_made_beside_the_loop():
    """Nothing deferred (no guard): `stage()` copies nothing on the loop's thread; the loop's
    own wait covers every tensor."""
    state, copies = on_devices(a=(torch.ones(3), CUDA0), b=(torch.ones(2), CUDA0))
    stager = ReusableStager(CUDA0, copies=lambda: copies)
    gate = threading.Event()
    stager._worker.submit(gate.wait)  # hold the stager's thread
    future = stager.stage(state)
    assert [entry[0] for entry in copies.log] == ["ready"]  # queued nothing yet
    gate.set()
    future.result()
    assert ("queue", CUDA0, 2) in copies.log
    stager.close()


class Path:
    """A save path that records the parameters' sum at each wait, and what it was told to defer."""

    def __init__(self, model):
        self.model, self.waits, self.deferred = model, [], None

    def wait_for_staging(self) -> float:
        self.waits.append(float(self.model.weight.detach().sum()))
        return 0.0

    def defer(self, tensors, share) -> None:
        self.deferred, self.share = tensors, share


class Recorder:
    def waited(self, seconds: float) -> None:
        pass


class State:
    def __init__(self, model, *optimizers):
        self.model, self._optimizers = model, optimizers

    def optimizers(self):
        return list(self._optimizers)


class Wrapped:
    """A framework's optimizer wrapper (Accelerate's keeps the torch one as `optimizer`)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_the_guard_waits_right_before_each_optimizer_step_and_lets_go_at_the_end():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = Path(model)
    guard = StepGuard((path,), Recorder())
    guard.arm(State(model, Wrapped(optimizer)))
    storages = {tensor.untyped_storage().data_ptr() for tensor in path.deferred}
    assert guard.armed and {p.untyped_storage().data_ptr() for p in model.parameters()} <= storages
    assert len(path.deferred) == 2 + 2 * 3  # the parameters; each one's step, exp_avg, exp_avg_sq
    guard.wait_for_staging()  # the loop's own wait: taken by the hook instead
    assert path.waits == []
    before = float(model.weight.detach().sum())
    optimizer.step()
    assert path.waits == [before]  # waited with the parameters still as saved
    guard.release()
    optimizer.step()
    assert len(path.waits) == 1 and not guard.armed


def test_an_optimizer_that_takes_no_hook_leaves_the_wait_where_the_loop_takes_it():
    model = torch.nn.Linear(2, 2)
    path = Path(model)
    guard = StepGuard((path,), Recorder())
    guard.arm(State(model, object()))
    assert path.deferred == [] and path.share == (0, 1) and not guard.armed
    guard.wait_for_staging()
    assert len(path.waits) == 1
    outer = Wrapped(Wrapped("inner"))
    assert wrapped(outer) == [outer, outer.optimizer, "inner"]


def test_a_deferred_tensor_changed_before_its_copy_fails_the_save_and_nothing_is_committed(tmp_path):
    """A loop that changes a parameter in place between a save and its next optimizer step
    (an EMA swapped in for evaluation) while the copy is still to be made: one line (exit 2)
    at the step's wait, and the torn generation is never committed."""
    import pytest

    from trainer.checkpoint.checkpointer import AsyncCheckpointer
    from trainer.checkpoint.commit import RenameCommit
    from trainer.checkpoint.manifest import GenerationFacts
    from trainer.checkpoint.section import LocalSection
    from trainer.errors import ChangedWhileStaged

    weight = torch.ones(1024)
    store = LocalSection(tmp_path / "checkpoints")
    checkpointer = AsyncCheckpointer(RenameCommit(store), "test", torch.device("cpu"))
    checkpointer.defer([weight])
    gate = threading.Event()
    checkpointer.stager._worker.submit(gate.wait)  # the copy has not started yet
    checkpointer.save({"weight": weight}, GenerationFacts(1, 0, 1, {}, (), {}, "test"))
    weight.mul_(2)  # the EMA swapped in, before the optimizer step
    gate.set()
    with pytest.raises(ChangedWhileStaged, match="changed in place between a save and the next optimizer step"):
        checkpointer.wait_for_staging()
    assert ChangedWhileStaged.exit_code == 2
    checkpointer.close_after_failure()
    assert store.names() == []


def test_a_device_tensor_changed_before_the_steps_fence_is_torn():
    """On a device the copy runs later on a side stream: an in-place change queued before the
    optimizer step's fence may overtake it, so it fails the save."""
    import pytest

    from trainer.errors import ChangedWhileStaged

    state, copies = on_devices(w=(torch.ones(4), CUDA1))
    stager = ReusableStager(CUDA0, copies=lambda: copies)
    stager.defer(state.values())
    stager.stage(state).result()
    state["w"].mul_(2)
    with pytest.raises(ChangedWhileStaged):
        stager.fence()
    assert stager.torn is not None
    stager.close()


def test_a_change_after_the_copy_is_harmless():
    weight = torch.ones(8)
    stager = ReusableStager(torch.device("cpu"))
    stager.defer([weight])
    staged = stager.stage({"weight": weight}).result()  # copied
    weight.add_(1)  # before the step's fence, but after the copy: the copy is whole
    stager.fence()
    assert stager.torn is None and torch.equal(staged["weight"], torch.ones(8))
    stager.close()


def test_a_torch_optimizer_that_wraps_another_is_hooked_too():
    """A Lookahead-style wrapper changes the parameters in its own step, around the inner
    one's: its step waits first."""
    class Outer(torch.optim.Optimizer):
        def __init__(self, inner):
            super().__init__(inner.param_groups[0]["params"], {})
            self.optimizer = inner

        def step(self, closure=None):
            with torch.no_grad():
                for parameter in self.param_groups[0]["params"]:
                    parameter.mul_(0.5)  # before the inner step
            self.optimizer.step()

    model = torch.nn.Linear(3, 2)
    outer = Outer(torch.optim.SGD(model.parameters(), lr=0.1))
    path = Path(model)
    guard = StepGuard((path,), Recorder())
    guard.arm(State(model, outer))
    before = float(model.weight.detach().sum())
    model(torch.ones(1, 3)).sum().backward()
    outer.step()
    assert path.waits[0] == before and len(path.waits) == 2  # the outer step's wait came first
    guard.release()
