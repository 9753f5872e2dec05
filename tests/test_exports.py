"""Exports: weights-only safetensors that load without our code and equal the recovery weights."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from support.cli import one_error_line, run_cli, train
from trainer.checkpoint.snapshot import load_flat


def test_export_equals_recovery_weights_and_loads_without_trainer(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 4, "--export-every-epochs", 2, "--keep-exports", 5)
    exports = sorted(p.name for p in (run / "exports").iterdir())
    assert exports == ["step-00000016", "step-00000032"]
    for name in exports:
        weights = load_file(run / "exports" / name / "model.safetensors")
        state = load_flat(run / "checkpoints" / name)
        assert weights.keys() == {k.removeprefix("model.") for k in state if k.startswith("model.")}
        for key, tensor in weights.items():
            assert torch.equal(tensor.view(torch.uint8), state[f"model.{key}"].reshape(-1).view(torch.uint8).reshape(tensor.view(torch.uint8).shape))
        config = json.loads((run / "exports" / name / "config.json").read_text())
        assert config["architecture"] == "MLP" and config["step"] == int(name[5:]) and config["dtype"] == "float32"
    # A process that cannot import the trainer package rebuilds the model from config.json alone.
    script = (
        "import json, sys, torch\n"
        "from safetensors.torch import load_file\n"
        "assert 'trainer' not in sys.modules\n"
        "d = sys.argv[1]; c = json.load(open(d + '/config.json')); w = load_file(d + '/model.safetensors')\n"
        "layers = []; width = c['features']\n"
        "for _ in range(c['layers']):\n"
        "    layers += [torch.nn.Linear(width, c['hidden_size']), torch.nn.GELU(), torch.nn.Dropout(c['dropout'])]; width = c['hidden_size']\n"
        "layers.append(torch.nn.Linear(width, c['classes']))\n"
        "m = torch.nn.Sequential(*layers); m.load_state_dict({k.removeprefix('net.'): v for k, v in w.items()})\n"
        "print(m.eval()(torch.zeros(1, c['features'])).shape)\n")
    result = subprocess.run([sys.executable, "-I", "-c", script, str(run / "exports" / "step-00000032")],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([1, 4])" in result.stdout


def test_export_dtype_and_keep_exports(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 3, "--export-every-steps", 4, "--keep-exports", 2, "--export-dtype", "bfloat16")
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step-00000020", "step-00000024"]
    weights = load_file(run / "exports" / "step-00000024" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert run_cli("verify", run).returncode == 0


def test_bad_export_options_are_refused(tmp_path):
    result = run_cli("--output", tmp_path / "r", "--export-dtype", "int3")
    assert result.returncode == 2 and "--export-dtype" in one_error_line(result)
