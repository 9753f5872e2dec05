"""The exactness witness (trainer/run/witness.py): a resume checks itself, without compare.py.
A deliberately broken restore (the RNGs left unrestored, as when they are restored before
something consumes randomness) is seen twice: the restored state differs from the digest its
save stored, and the replayed steps differ from what the lost attempt computed."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from torch import nn

from support.cli import run_cli, train
from support.runs import attempts
from trainer.checkpoint.manifest import GenerationFacts, InvalidManifest, Manifest
from trainer.run.checksum import (BLOCK_BYTES, BLOCK_WORDS, CHUNK_BYTES, parameter_checksum, state_digests,
                                  tensor_checksum, weighted_block_sums)
from trainer.run.witness import ReplayWitness, read_step_digests, restore_problem, step_digest

ARGS = ("--epochs", 2, "--recover-every-steps", 4)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """16 steps, interrupted after step 11: generations at 4 and 8, steps 9-11 lost."""
    run = tmp_path_factory.mktemp("witness") / "run"
    train(run, *ARGS, "--interrupt-at-step", 11, expect=75)
    return run


def test_an_exact_resume_is_witnessed_exact(interrupted, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    resumed = train(run, *ARGS, "--resume")
    assert "exactness witness" not in resumed.stdout + resumed.stderr
    record = attempts(run)[-1]
    assert record["restore_check"] == {"matched": True}
    assert record["replay"] == {"matched": 3, "of": 3, "first_mismatch": None, "against": [attempts(run)[0]["id"]]}
    assert len(read_step_digests(run / "attempts" / record["id"])) == 8  # steps 9..16
    report = run_cli("report", run)
    assert "exactness witness  every check passed: 1 restore and 1 replay matched" in report.stdout
    assert "restore matched the saved state; replayed steps matched: 3 of 3" in report.stdout


def test_a_broken_restore_is_reported_by_both_checks(interrupted, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    resumed = train(run, *ARGS, "--resume", env={"TRAINER_DEBUG_SKIP_RNG_RESTORE": "torch"})
    said = resumed.stdout + resumed.stderr
    assert "exactness witness: step-00000008 was restored into a state other than the one saved (rank 0: rng)" in said
    assert "exactness witness: replayed step 9 differs from what attempt" in said
    record = attempts(run)[-1]
    assert record["restore_check"] == {"matched": False, "differing": {"0": ["rng"]}}
    assert record["replay"]["first_mismatch"] == 9 and record["replay"]["matched"] == 0
    report = run_cli("report", run).stdout
    assert "exactness witness  NOT EXACT" in report
    assert "restore DIFFERS from the saved state (rank 0: rng); replay DIFFERS from step 9 (0 of 3 matched)" in report


def test_going_back_compares_only_with_attempts_that_trained_the_same_way(interrupted, tmp_path):
    """A (this fixture) lost steps 9-11; B resumed with another --lr (allowed drift) and computed
    steps 9-14 differently on purpose; C goes back to step 8 with A's options: its replay is held
    against A, never against B. `report`'s headline counts B's replay as not compared."""
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    train(run, *ARGS, "--resume", "--lr", 0.2, "--allow-drift", "config", "--interrupt-at-step", 14, expect=75)
    drifted = attempts(run)[-1]
    assert drifted["replay"]["compared"] is False and "config" in drifted["replay"]["reason"]
    went_back = train(run, *ARGS, "--from-generation", "step-00000008")
    assert "exactness witness" not in went_back.stdout + went_back.stderr
    first, _, last = attempts(run)
    assert last["replay"] == {"matched": 3, "of": 3, "first_mismatch": None, "against": [first["id"]]}
    report = run_cli("report", run).stdout  # issue #43: never "every check passed" when a check did not run
    assert "exactness witness  2 restores and 1 replay matched; not compared: 1 replay (see below)" in report
    assert "restore matched the saved state; replay not compared: allowed drift (config.lr: 0.05 → 0.2)" in report


def test_a_resume_with_nothing_to_replay_is_recorded_as_not_compared():
    """A kill -9 right at a save leaves no step past it: the resume's replay is "not compared"
    (so `report` never says every check passed); a fresh start has nothing to replay at all."""
    resumed = ReplayWitness({}, restored_step=8)
    resumed.step(9, step_digest(0.5, 1))
    record = resumed.as_record()
    assert record["compared"] is False and "past step 8" in record["reason"]
    fresh = ReplayWitness({})
    fresh.step(1, step_digest(0.5, 1))
    assert fresh.as_record() is None
    replayed = ReplayWitness({9: (step_digest(0.5, 1), "a1")}, restored_step=8)
    replayed.step(9, step_digest(0.5, 1))
    assert replayed.as_record() == {"matched": 1, "of": 1, "first_mismatch": None, "against": ["a1"]}


def test_the_parameter_checksum_sees_one_flipped_bit_in_any_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        model = nn.Linear(7, 3).to(dtype)  # 21 weights: not whole 64-bit words in bf16 and float32
        parameters = list(model.parameters())
        before = parameter_checksum(parameters, 0)
        with torch.no_grad():
            bits = model.weight.view(-1)[5:6].view({2: torch.int16, 4: torch.int32, 8: torch.int64}[
                model.weight.element_size()])
            bits ^= 1  # the last bit of one element
        assert parameter_checksum(parameters, 0) != before, dtype
    pair = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    before = parameter_checksum(list(pair.parameters()), 0)
    with torch.no_grad():  # two parameters trading places: each parameter is weighted by its place
        first = pair[0].weight.clone()
        pair[0].weight.copy_(pair[1].weight)
        pair[1].weight.copy_(first)
    assert parameter_checksum(list(pair.parameters()), 0) != before


def test_a_step_checks_a_rotating_share_of_many_parameters():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(40)])  # 80 parameters: every 5th per step
    parameters = list(model.parameters())
    original = [p.detach().clone() for p in parameters]
    with torch.no_grad():
        parameters[7].view(-1)[0] += 1
    assert [step for step in range(10) if parameter_checksum(parameters, step) != parameter_checksum(original, step)] \
        == [2, 7], "parameter 7 is read at steps 2, 7, 12, …"


def test_the_state_checksum_sees_values_trade_places_and_reads_any_slice():
    assert int(tensor_checksum(torch.tensor([1.0, 2.0], dtype=torch.float64))) != \
        int(tensor_checksum(torch.tensor([2.0, 1.0], dtype=torch.float64)))
    whole = torch.arange(10, dtype=torch.float32)
    assert int(tensor_checksum(whole[1:])) == int(tensor_checksum(whole[1:].clone())), "a slice at any offset"


def test_the_chunked_state_checksum_is_the_same_for_every_chunk_size_and_what_generations_hold():
    """A state digest reads a tensor a chunk at a time (its temporaries bounded): the value must
    not depend on the chunk size, for any dtype, size, offset or layout, and must stay what the
    digests generations already hold say (the values below were computed before chunking)."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool):
        for size in (0, 1, 7, BLOCK_WORDS + 3, 3 * BLOCK_WORDS * 2 + 5):
            values = (torch.randn(size, generator=generator) * 1e6).to(dtype)
            pieces = {"whole": values, "slice at an odd offset": values[1:],
                      "not contiguous": values[:size // 2 * 2].view(2, -1).t()}
            for what, tensor in pieces.items():
                for weighted in (True, False):
                    unchunked = int(tensor_checksum(tensor, weighted, chunk_bytes=1 << 40))
                    for chunk in (1, BLOCK_BYTES, 3 * BLOCK_BYTES + 5):
                        assert int(tensor_checksum(tensor, weighted, chunk_bytes=chunk)) == unchunked, \
                            (dtype, size, what, weighted, chunk)
    known = torch.arange(2 * BLOCK_WORDS * 3 + 7, dtype=torch.float32).mul_(1.5)
    assert (int(tensor_checksum(known, chunk_bytes=BLOCK_BYTES)), int(tensor_checksum(known, weighted=False)),
            int(tensor_checksum(known[1:], chunk_bytes=BLOCK_BYTES))) == \
        (-7346728267018535200, 7535162511504480, 1707569224377112448)
    assert state_digests({"model": {"w": known, "b": known[1:].to(torch.bfloat16)}, "x": {"n": 3}}) == \
        {"model": "c4dae9c7b86a391a", "x": "00be66cf49294433"}


def test_the_state_checksum_allocates_a_chunk_at_most_not_the_tensor():
    """Its largest temporary is a chunk's, whatever the tensor's size (measured with torch's
    allocation profiler on a 1 MB slice at an odd offset, which used to be copied whole)."""
    from torch.profiler import ProfilerActivity, profile

    assert CHUNK_BYTES <= 64 << 20
    tensor = torch.zeros(1 << 20, dtype=torch.uint8)[3:]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        tensor_checksum(tensor, chunk_bytes=2 * BLOCK_BYTES)
    largest = max(event.cpu_memory_usage for event in profiled.events())
    assert 0 < largest <= 2 * BLOCK_BYTES, largest


def test_the_cpu_block_sums_by_one_product_equal_the_wrapping_sums_of_every_word():
    """The fast CPU path (an int64 matrix-vector product) must give the digests generations
    already hold: the same sums modulo 2**64, compared with numpy's defined uint64 wrap-around."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(-2**63, 2**63 - 1, (33, BLOCK_WORDS), dtype=torch.int64, generator=generator)
    odd = torch.arange(1, 2 * BLOCK_WORDS, 2, dtype=torch.int64)
    expected = (blocks.numpy().astype(np.uint64) * odd.numpy().astype(np.uint64)).sum(1, dtype=np.uint64)
    assert np.array_equal(weighted_block_sums(blocks, odd).numpy().astype(np.uint64), expected)


def test_state_digests_name_the_section_that_differs():
    state = {"model": {"w": torch.arange(4.0)}, "rng": {"torch": torch.tensor([1, 2], dtype=torch.uint8)},
             "progress": {"global_step": 8}}
    saved = state_digests(state)
    assert restore_problem(saved, state_digests(state)) == []
    state["rng"]["torch"][0] = 9
    state["progress"]["global_step"] = 9
    assert restore_problem(saved, state_digests(state)) == ["progress", "rng"]


def test_the_step_log_skips_a_torn_last_line(tmp_path):
    digest = step_digest(1.5, 7)
    (tmp_path / "step_digests").write_text(f"1 {digest}\n2 {digest}\n3 {digest[:9]}")
    assert read_step_digests(tmp_path) == {1: digest, 2: digest}


def test_a_replay_is_not_compared_under_drift_and_not_recorded_without_one():
    earlier = {9: (step_digest(1.0, 1), "a")}
    assert ReplayWitness({}).as_record() is None
    drifted = ReplayWitness(earlier, "allowed drift (world_size)")
    assert drifted.step(9, step_digest(2.0, 1)) is False
    assert drifted.as_record() == {"compared": False, "reason": "allowed drift (world_size)"}
    witness = ReplayWitness(earlier)
    assert witness.step(9, step_digest(1.0, 2)) is True, "a parameter difference with an equal loss is a mismatch"
    assert witness.as_record()["first_mismatch"] == 9


def test_the_state_digest_travels_in_the_manifest_and_a_malformed_one_is_refused():
    facts = GenerationFacts(8, 1, 0, {}, (), {}, "2026-12-02T00:00:00Z", {"0": {"model": "ab" * 8}})
    data = Manifest.for_generation(facts, "attempt", {}, {}).to_json()
    assert Manifest.from_json(data).facts.state_digest == {"0": {"model": "ab" * 8}}
    with pytest.raises(InvalidManifest, match="state_digest"):
        Manifest.from_json({**data, "state_digest": ["x"]})
