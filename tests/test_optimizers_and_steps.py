"""Wider training than one optimizer and `loss(model, batch)` (issue #29): named optimizers
and schedulers, a custom `train_step` (a GAN, a closure optimizer), state created lazily
(through the optimizer, through `stateful()`, a dict that grows), and `torch.compile`, each
killed mid-run and resumed to the uninterrupted run's bits, end to end through the real CLI;
what the protocol cannot express is refused before the first step."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from support.cli import compare, one_error_line, run_cli, train
from support.runs import generation

GAN = ("--workload", "examples/tiny_gan.py:TinyGAN", "--batch-size", 16, "--epochs", 3, "--grad-accum", 2)
GAN_FINAL = "step-00000006"  # 64 points, 4 batches per epoch, 2 per step
EDGE = ("--workload", "tests/workloads/edge_cases.py:EdgeCase", "--epochs", 3, "--batch-size", 8)
CLOSURE = ("--workload", "tests/workloads/edge_cases.py:ClosureStep", "--epochs", 3, "--batch-size", 8)
FINAL = "step-00000009"


def fields(result) -> dict[str, bool]:
    return {field["field"]: field["equal"] for field in json.loads(result.stdout)["fields"]}


def interrupted_and_resumed(tmp_path, args, final: str, interrupt: int, resume_args=()) -> dict[str, bool]:
    """The uninterrupted run against one killed after step `interrupt` (saves every 2 steps)
    and resumed; every compared field, which must all be equal."""
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    train(baseline, *args)
    train(run, *args, "--recover-every-steps", 2, "--interrupt-at-step", interrupt, expect=75)
    train(run, *args, "--resume", *resume_args)
    result = compare(generation(baseline, final), generation(run, final), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return fields(result)


@pytest.mark.parametrize("discriminator", ["named", "stateful"])
def test_a_gan_with_two_optimizers_and_its_own_step_resumes_exactly(tmp_path, discriminator):
    """Adam's state appears at its first step: restored through the named optimizers, or,
    with the discriminator's Adam kept in stateful(), through the workload's extras (both used
    to fail: a traceback, or exit 65 '18 stored entries ... would not read'). The EMA, a dict
    that grows at the first step, restores from the stored metadata. Accumulation over 2
    micro-batches and --amp (bf16 autocast on CPU) go through the step tools. ~8 s."""
    equal = interrupted_and_resumed(tmp_path, (*GAN, "--amp", "--discriminator-optimizer", discriminator),
                                    GAN_FINAL, interrupt=3)
    assert all(equal.values())
    adam = [name for name in equal if name.endswith("exp_avg_sq")]
    kept = "workload.discriminator_optimizer.state." if discriminator == "stateful" else "optim.discriminator.state."
    assert any(name.startswith(kept) for name in adam) and any(name.startswith("optim.generator.") for name in adam)
    assert any(name.startswith("scheduler.generator.") for name in equal)
    assert any(name.startswith("workload.generator_ema.") for name in equal)


def test_a_closure_optimizer_runs_through_train_step_and_resumes_exactly(tmp_path):
    """LBFGS: its step needs a closure (it used to be a TypeError traceback) and its history
    appears only on real iterations; restored from the stored metadata. ~6 s."""
    equal = interrupted_and_resumed(tmp_path, CLOSURE, FINAL, interrupt=5)
    assert any(name.startswith("optim.state.0.weight.old_dirs.") for name in equal)


@pytest.mark.parametrize("case, says", [
    ("optimizer-list", "build_optimizer returned a list; return one torch.optim.Optimizer, or a dict of them"),
    ("shared-parameter", "to both 'body' and 'head'; give each parameter to one optimizer"),
    ("lbfgs", "the optimizer LBFGS needs a closure, which the trainer's own step cannot give: define train_step"),
])
def test_what_the_trainers_step_cannot_run_is_refused_before_the_first_step(tmp_path, case, says):
    """One line, exit 2, nothing trained or saved (a list of optimizers used to be an
    AttributeError traceback after the attempt started). ~1.5 s each."""
    result = run_cli("--output", tmp_path / "run", *EDGE, "--case", case)
    assert result.returncode == 2 and says in one_error_line(result), result.stderr
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))


def test_a_compiled_model_exports_and_saves_under_its_own_names(tmp_path):
    """torch.compile (eager backend: no C++ build in the test) wraps the model in
    `_orig_mod`; the export used to carry that prefix and did not load into the uncompiled
    model. Resume stays exact. ~6 s."""
    equal = interrupted_and_resumed(tmp_path, (*EDGE, "--case", "compiled"), FINAL, interrupt=5)
    assert "model.0.weight" in equal and not any("_orig_mod" in name for name in equal)
    weights = load_file(tmp_path / "baseline" / "exports" / FINAL / "model.safetensors")
    assert sorted(weights) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    uncompiled = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 1))
    uncompiled.load_state_dict(weights)  # strict: every key the model's own
    assert torch.equal(uncompiled[0].weight, weights["0.weight"])


def test_a_custom_step_under_several_processes_or_a_closure_under_a_grad_scaler_is_refused():
    """Unit test of the start-time refusals no single CPU process reaches: a train_step under
    torchrun (its forward passes could bypass DDP's gradient reduction) and LBFGS under a
    CUDA GradScaler (which cannot step a closure). Milliseconds."""
    from trainer.errors import UsageError
    from trainer.workload import BoundWorkload

    class Closure:
        def train_step(self, model, optimizers, batches, step):
            raise AssertionError("never called")

    bound = BoundWorkload(Closure(), (), "closure.py:Closure")
    lbfgs = torch.optim.LBFGS([nn.Parameter(torch.ones(2))])
    bound.refuse_inexpressible(lbfgs, scaling=False, world_size=1)
    with pytest.raises(UsageError, match="train_step runs in one process only"):
        bound.refuse_inexpressible(lbfgs, scaling=False, world_size=2)
    with pytest.raises(UsageError, match="GradScaler .* cannot step: run without --amp"):
        bound.refuse_inexpressible(lbfgs, scaling=True, world_size=1)
