"""Recovery in a user's own loop (trainer/recovery/, docs/library.md), through the real thing:
the example scripts run as processes, killed with kill -9 and stopped with SIGTERM, resumed,
and compared field by field with an uninterrupted run; the witness's verdict read from the
attempt records that `report` reads."""

from __future__ import annotations

import signal
import subprocess

import pytest

from conftest import REPO, attempts, compare, generation, run_cli, scaled, trainer_env, zygote

EXAMPLES = {
    # name: (script, its options, the step after which kill -9 lands, the generation it leaves
    # (mid-epoch), the step after which SIGTERM lands, the final generation)
    "own-loop": ("own_loop.py", ("--epochs", "3"), 13, "step-00000010", 24, "step-00000036"),  # 12 batches an epoch
    "accelerate": ("accelerate_loop.py", ("--epochs", "3"), 13, "step-00000010", 24, "step-00000036"),
    "lightning": ("lightning_loop.py", ("--epochs", "3"), 13, "step-00000010", 24, "step-00000036"),
    "hf-trainer": ("hf_trainer.py", (), 7, "step-00000005", 11, "step-00000018"),  # 6 steps an epoch
}


def run_until(script, output, step: int, stop: int, *args) -> tuple[subprocess.Popen, str]:
    """The script on `output`, sent `stop` once it printed `step=<step>` (or a later step)."""
    process = zygote().spawn([str(script), str(output), *map(str, args)], REPO, trainer_env(), new_session=False)
    for line in process.stdout:
        if line.startswith("step=") and int(line.split()[0].split("=")[1]) >= step:
            process.send_signal(stop)
            break
    out, err = process.communicate(timeout=scaled(300))
    return process, err


@pytest.mark.parametrize("name", EXAMPLES)
def test_killed_and_preempted_mid_epoch_resumes_equal_to_an_uninterrupted_run(tmp_path, name):
    script, options, kill_at, left, stop_at, final = EXAMPLES[name]
    script = REPO / "examples" / script
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    assert run_cli(script, baseline, *options).returncode == 0

    killed, _ = run_until(script, run, kill_at, signal.SIGKILL, *options)
    assert killed.returncode == -signal.SIGKILL
    assert generation(run, left).is_dir()

    preempted, err = run_until(script, run, stop_at, signal.SIGTERM, *options)
    assert preempted.returncode == 75, err
    assert "stopped, resumable (exit 75)" in err
    stopped_at = attempts(run)[-1]["last_step"]
    assert generation(run, f"step-{stopped_at:08d}").is_dir()  # saved at the step reached

    finished = run_cli(script, run, *options)
    assert finished.returncode == 0, finished.stderr
    assert compare(generation(baseline, final), generation(run, final)).returncode == 0
    records = attempts(run)
    assert [record["status"] for record in records] == ["running", "preempted", "completed"]
    resumed = records[1]
    assert resumed["restored"]["name"] == left
    assert resumed["replay"]["matched"] == resumed["replay"]["of"] > 0  # the steps the kill lost, recomputed equal
    assert all(record["restore_check"]["matched"] for record in records[1:])


OWN_SHUFFLE = """
import itertools, sys
import torch
from torch import nn
from trainer import recovery

recovery.seed_everything(0)
inputs = torch.randn(96, 4)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, inputs.sum(1, keepdim=True)),
                                     batch_size=8, shuffle=True)  # its own order: a new shuffle on resume
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
interrupt = int(sys.argv[2]) if len(sys.argv) > 2 else None
with recovery.open_run(sys.argv[1], resume="auto", interrupt_at_step=interrupt,
                       recover=recovery.CadenceConfig(every_steps=5)) as run:
    done = run.restore(model, optimizer).global_step
    for epoch in range(done // len(loader), 2):
        for x, y in itertools.islice(loader, done % len(loader) if epoch == done // len(loader) else 0, None):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
"""


def test_a_loop_with_its_own_shuffle_is_reported_not_exact(tmp_path):
    """Without KeyedData the resumed epoch is drawn anew: the witness names the first replayed
    step that differs, and `report` says so."""
    script, run = tmp_path / "own_shuffle.py", tmp_path / "run"
    script.write_text(OWN_SHUFFLE)
    assert run_cli(script, run, 7).returncode == 75  # a lost worker after step 7; the newest generation is step 5
    assert run_cli(script, run).returncode == 0
    assert attempts(run)[1]["replay"]["first_mismatch"] == 6
    assert "replay DIFFERS from step 6" in run_cli("report", run).stdout
