"""The example workloads under examples/ (outside the trainer package), end to end: a stop
that lands inside an accumulation window, mid-epoch, with DataLoader workers; a resume with a
different worker count; the final generation bit-identical to an uninterrupted run with yet
another worker count; the export loadable with safetensors alone."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from support.cli import compare, train
from support.runs import generation

GPT = ("--workload", "examples/char_gpt.py:CharGPT", "--batch-size", 8, "--grad-accum", 2, "--amp",
       "--epochs", 3, "--blocks-per-epoch", 24)  # 3 micro-batches per epoch: windows of 2 and 1
CNN = ("--workload", "examples/small_cnn.py:SmallCNN", "--batch-size", 16, "--grad-accum", 2,
       "--epochs", 3)  # 64 images: 4 micro-batches per epoch, windows of 2 and 2
FINAL = "step-00000006"
CASES = {
    # name: (options, micro-batch after which SIGTERM arrives, generation it saves, its (epoch, position))
    "gpt": (GPT, 4, "step-00000003", (1, 2)),
    "cnn": (CNN, 5, "step-00000003", (1, 2)),
}


@pytest.mark.parametrize("name", CASES)
def test_stopped_inside_a_window_resumed_with_other_workers_equals_the_baseline(tmp_path, name):
    options, signal_at, saved, (epoch, position) = CASES[name]
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    train(baseline, *options, "--num-workers", 1)
    train(run, *options, "--num-workers", 2, expect=75, env={"TRAINER_SIGNAL_AT_MICRO_BATCH": str(signal_at)})
    manifest = json.loads((generation(run, saved) / "manifest.json").read_text())
    assert (manifest["epoch"], manifest["position"]) == (epoch, position)  # mid-epoch, at a window's end
    resumed = train(run, *options, "--resume", "--num-workers", 0)
    assert f"restored {saved}" in resumed.stdout
    result = compare(generation(baseline, FINAL), generation(run, FINAL))
    assert result.returncode == 0, result.stdout

    export = run / "exports" / FINAL
    weights = load_file(str(export / "model.safetensors"))
    config = json.loads((export / "config.json").read_text())
    assert config["architecture"] in ("TinyGPT", "SmallCNN") and weights
    if name == "gpt":
        assert weights["head.weight"].data_ptr() != weights["tokens.weight"].data_ptr()
        assert (weights["head.weight"] == weights["tokens.weight"]).all()  # tied, stored twice
    else:
        assert "features.0.1.running_mean" in weights  # BatchNorm statistics travel with the weights


def test_the_transformers_example_exports_what_from_pretrained_loads(tmp_path):
    """examples/hf_gpt2.py: a GPT-2 from a config, trained on the streaming token shards for 4
    steps; its export directory loads with `GPT2LMHeadModel.from_pretrained`, every weight as
    trained and nothing missing or unexpected (`architecture()` returns the config's dict).
    Cost: ~20 s (transformers imports in two processes)."""
    import torch
    from transformers import GPT2LMHeadModel

    run = tmp_path / "run"
    train(run, "--workload", "examples/hf_gpt2.py:HFGPT2", "--shard-dir", tmp_path / "shards", "--max-steps", 4,
          "--batch-size", 8)
    export = run / "exports" / "step-00000004"
    model, info = GPT2LMHeadModel.from_pretrained(export, output_loading_info=True)
    assert {key: set(value) if isinstance(value, (set, list)) else value for key, value in info.items()} == {
        "missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": set()}
    weights = load_file(str(export / "model.safetensors"))
    state = model.state_dict()
    assert weights and all(torch.equal(state[name], value) for name, value in weights.items())
