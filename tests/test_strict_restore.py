"""Strict restore: every stored entry is read and every expected one is present, or the
restore is refused (65) naming the keys. Without it DCP skips what the template lacks and
training silently continues with that part fresh (the accumulating-optimizer case)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.errors import FingerprintMismatch, UsageError
from trainer.checkpoint.restore import load_into
from trainer.checkpoint.snapshot import write_snapshot
from trainer.run.state import TrainingState


class AccumulatingAdamW(torch.optim.AdamW):
    """A gradient-accumulation wrapper as users write them: only every `every`-th call
    steps, so the zero steps that materialise optimizer state create none (the trainer's
    and DCP's own: two calls) and the template has none."""

    def __init__(self, params, every: int, **options):
        super().__init__(params, **options)
        self.every, self.calls = every, 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure) if self.calls % self.every == 0 else None


def make_state(optimizer_class=torch.optim.AdamW, extra_buffer: bool = False, world_size: int = 1,
               **options) -> TrainingState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    if extra_buffer:
        model.register_buffer("running", torch.zeros(3))
    optimizer = optimizer_class(model.parameters(), lr=0.1, **options)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    return TrainingState(model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False),
                         world_size=world_size)


def trained(state: TrainingState, steps: int = 4) -> TrainingState:
    for _ in range(steps):
        state.model(torch.randn(5, 4)).pow(2).mean().backward()
        state.optimizer.step()
        state.scheduler.step()
        state.history.loss.append(0.0), state.history.lr.append(0.0)
    return state


def saved(tmp_path, state: TrainingState):
    directory = tmp_path / "generation"
    directory.mkdir()
    write_snapshot(state.state_dict(), directory)
    return directory


def test_lazily_created_optimizer_state_is_restored(tmp_path):
    source = trained(make_state())
    directory = saved(tmp_path, source)
    fresh = make_state()
    assert not fresh.optimizer.state  # created lazily, on the first step
    load_into("step-00000004", directory, fresh)
    for param, restored in zip(source.model.parameters(), fresh.model.parameters()):
        assert torch.equal(source.optimizer.state[param]["exp_avg"], fresh.optimizer.state[restored]["exp_avg"])


def test_an_accumulating_optimizer_is_refused_not_restored_fresh(tmp_path):
    directory = saved(tmp_path, trained(make_state(AccumulatingAdamW, every=4), steps=8))
    with pytest.raises(FingerprintMismatch) as refused:
        load_into("step-00000008", directory, make_state(AccumulatingAdamW, every=4))
    message = str(refused.value)
    assert "12 stored entries" in message and "optim.state.0.bias.exp_avg" in message
    assert "lazily" in message and "\n" not in message


def test_a_stored_entry_the_live_state_does_not_expect_is_refused(tmp_path):
    directory = saved(tmp_path, trained(make_state(extra_buffer=True)))
    with pytest.raises(FingerprintMismatch, match=r"1 stored entries .* \(model.running\)"):
        load_into("step-00000004", directory, make_state())


def test_an_expected_entry_that_was_not_stored_is_refused(tmp_path):
    directory = saved(tmp_path, trained(make_state()))
    with pytest.raises(FingerprintMismatch, match=r"1 entries it expects are not stored \(model.running\)"):
        load_into("step-00000004", directory, make_state(extra_buffer=True))


def test_other_ranks_entries_are_left_unread_by_design(tmp_path):
    """A 2-process generation restored by one process (an allowed world-size change): the
    data positions and the other rank's RNG are intentionally not loaded, and not refused: the
    entries every rank shares come back exactly."""
    source = trained(make_state(world_size=2))
    directory = saved(tmp_path, source)
    restored = make_state()
    load_into("step-00000004", directory, restored)
    for stored, loaded in zip(source.model.parameters(), restored.model.parameters()):
        assert torch.equal(stored, loaded)
        assert torch.equal(source.optimizer.state[stored]["exp_avg"], restored.optimizer.state[loaded]["exp_avg"])
    assert restored.scheduler.last_epoch == source.scheduler.last_epoch == 4


class Held:
    """What a loop holds between steps (a batch fetched ahead, a best loss), as `extras`."""

    def __init__(self, value: float):
        self.value = torch.tensor(value)

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, stored: dict) -> None:
        self.value = stored["value"].clone()


def holding(state: TrainingState, own: float, shared: float) -> TrainingState:
    state.rank_extras, state.extras = {"ahead": Held(own)}, {"ema": Held(shared)}
    return state


def test_each_ranks_extras_come_back_to_it_and_have_no_owner_at_another_world_size(tmp_path):
    """Issue 57: a loop's extras are each rank's own (`workload_by_rank.<rank>`), the shared
    ones stored once (`workload`). Restored at the same world size, each comes back; at
    another, the per-rank ones are refused in one line (exit 2) naming the fix, and a loop
    that declares only shared extras restores them."""
    source = holding(trained(make_state(world_size=2)), own=7.0, shared=3.0)
    stored = source.state_dict()
    assert set(stored["workload_by_rank"]) == {"0"} and set(stored["workload"]) == {"ema"}
    directory = saved(tmp_path, source)
    same = holding(make_state(world_size=2), own=0.0, shared=0.0)
    load_into("step-00000004", directory, same)
    assert same.rank_extras["ahead"].value.item() == 7.0 and same.extras["ema"].value.item() == 3.0
    with pytest.raises(UsageError) as refused:
        load_into("step-00000004", directory, holding(make_state(), own=0.0, shared=0.0))
    assert "the extras 'ahead' are kept per rank" in str(refused.value) and \
        "restore(shared_extras=...)" in str(refused.value) and refused.value.exit_code == 2
    declared_shared = make_state()
    declared_shared.extras = {"ema": Held(0.0)}
    load_into("step-00000004", directory, declared_shared)  # the other ranks' own extras: unread by design
    assert declared_shared.extras["ema"].value.item() == 3.0
