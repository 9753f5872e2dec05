"""Recovery in a user's own loop (trainer/recovery/, docs/library.md), through the real thing:
the example scripts run as processes, killed with kill -9 and stopped with SIGTERM, resumed,
and compared field by field with an uninterrupted run; the witness's verdict read from the
attempt records that `report` reads."""

from __future__ import annotations

import shutil
import signal
import struct
import subprocess
from pathlib import Path

import pytest

from support.cli import REPO, compare, run_cli, trainer_env, zygote
from support.limits import scaled
from support.runs import attempts, generation, made_once
from support.torchrun import rank_processes

EXAMPLES = {
    # name: (script, its options, the step after which kill -9 lands, the generation it leaves
    # (mid-epoch), the step after which SIGTERM lands, the final generation)
    "own-loop": ("own_loop.py", ("--epochs", "3"), 13, "step-00000010", 24, "step-00000036"),  # 12 batches an epoch
    "accelerate": ("accelerate_loop.py", ("--epochs", "3"), 13, "step-00000010", 24, "step-00000036"),
    "lightning": ("lightning_loop.py", ("--epochs", "3"), 13, "step-00000010", 24, "step-00000036"),
    "hf-trainer": ("hf_trainer.py", (), 8, "step-00000005", 11, "step-00000018"),  # 6 steps an epoch
}
"""A step's digest is read after the next step is queued (trainer/run/readback.py): a kill -9
right after step N leaves the digests through N-1 at least, so the kill lands two steps past
the generation for the resume to have a lost step to replay (HF prints its step line before
the adapter's callback runs)."""
PRELOAD = {"hf_trainer.py": "transformers", "hf_stopped.py": "transformers"}
"""What the zygote imports before it forks a script (tests/forking.py PRELOADABLE): about 3 CPU-s
of each HF process's."""


def run_until(script, output, step: int, stop: int, *args) -> tuple[subprocess.Popen, str]:
    """The script on `output`, sent `stop` once it printed `step=<step>` (or a later step)."""
    process = zygote().spawn([str(script), str(output), *map(str, args)], REPO, trainer_env(), new_session=False,
                             preload=PRELOAD.get(Path(script).name))
    for line in process.stdout:
        if line.startswith("step=") and int(line.split()[0].split("=")[1]) >= step:
            process.send_signal(stop)
            break
    out, err = process.communicate(timeout=scaled(300))
    return process, err


def example_baseline(tmp_path_factory, name: str):
    """The example's uninterrupted run, made once per session for every test that compares with it."""
    script, options = EXAMPLES[name][:2]

    def make(folder):
        finished = run_cli(REPO / "examples" / script, folder / "run", *options, preload=PRELOAD.get(script))
        assert finished.returncode == 0, finished.stderr[-3000:]

    return made_once(tmp_path_factory, f"library-{name}", make) / "run"


@pytest.mark.parametrize("name", EXAMPLES)
def test_killed_and_preempted_mid_epoch_resumes_equal_to_an_uninterrupted_run(tmp_path, tmp_path_factory, name):
    script, options, kill_at, left, stop_at, final = EXAMPLES[name]
    script = REPO / "examples" / script
    baseline, run = example_baseline(tmp_path_factory, name), tmp_path / "run"

    killed, _ = run_until(script, run, kill_at, signal.SIGKILL, *options)
    assert killed.returncode == -signal.SIGKILL
    assert generation(run, left).is_dir()

    preempted, err = run_until(script, run, stop_at, signal.SIGTERM, *options)
    assert preempted.returncode == 75, err
    assert "stopped, resumable (exit 75)" in err
    stopped_at = attempts(run)[-1]["last_step"]
    assert generation(run, f"step-{stopped_at:08d}").is_dir()  # saved at the step reached

    finished = run_cli(script, run, *options, preload=PRELOAD.get(script.name))
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


FORGOTTEN_PREFETCH = """
import os, signal, sys
import torch
from torch import nn
from trainer import recovery

recovery.seed_everything(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
stop = int(sys.argv[2]) if len(sys.argv) > 2 else None

def drawn():
    inputs = torch.randn(8, 4)
    return inputs, inputs.sum(1, keepdim=True)

with recovery.open_run(sys.argv[1], resume="auto", recover=recovery.CadenceConfig(every_steps=5)) as run:
    done = run.restore(model, optimizer).global_step
    ahead = drawn()
    for step in range(done + 1, 13):
        inputs, targets = ahead
        ahead = drawn()  # the next batch, fetched before this step ends: never handed over
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == stop:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption in this step
        run.step(loss)
"""


def test_a_sigterm_resume_of_a_loop_that_forgot_its_prefetched_batch_is_reported_not_exact(tmp_path):
    """The generation saved at the stop holds the RNG past the prefetched batch, which the loop
    never handed over: the step after the stop's save, computed for the witness and replayed by
    the resume, differs. Before issue 57 a stop's resume replayed nothing and `report` said
    every check passed. Cost: two forked processes, about 2 CPU-s."""
    script, run = tmp_path / "forgotten.py", tmp_path / "run"
    script.write_text(FORGOTTEN_PREFETCH)
    stopped = run_cli(script, run, 7)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert attempts(run)[0]["witness_step"] == 8 and generation(run, "step-00000007").is_dir()
    assert run_cli(script, run).returncode == 0
    assert attempts(run)[1]["replay"]["first_mismatch"] == 8
    report = run_cli("report", run).stdout
    assert "exactness witness  NOT EXACT" in report and "replay DIFFERS from step 8" in report, report


HF_STOPPED_AT_ITS_LAST_STEP = """
import os, signal, sys
sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
import hf_trainer

class StoppedAtTheLastStep(hf_trainer.StepLines):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == state.max_steps:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption inside the last step

hf_trainer.StepLines = StoppedAtTheLastStep
hf_trainer.main()
"""


def test_hugging_face_preempted_in_its_last_step_resumes_to_the_uninterrupted_run(tmp_path, tmp_path_factory):
    """examples/hf_trainer.py sent SIGTERM inside its last step (18): the generation of step 18,
    exit 75; the rerun has nothing left to train, and HF appends its end-of-training summary
    (wall-clock runtimes) to `log_history` before `train()` returns. The final generation must
    still equal the uninterrupted run's, summary-free (issue 47). The rerun does not warn that
    HF's arguments differ from the resumed `trainer_state.json`'s; every step's digest holds
    the loss HF logged for it; `report` says the data order is HF's and not tracked. Cost: two
    HF processes (~10 CPU-s) and the shared baseline."""
    script, run = tmp_path / "hf_stopped.py", tmp_path / "run"
    script.write_text(HF_STOPPED_AT_ITS_LAST_STEP)
    stopped = run_cli(script, run, preload=PRELOAD[script.name])
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert attempts(run)[0]["last_step"] == 18 and generation(run, "step-00000018").is_dir()

    resumed = run_cli(script, run, preload=PRELOAD[script.name])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "do not match the ones in the `trainer_state.json`" not in resumed.stderr, resumed.stderr[-3000:]
    assert "train_runtime" in resumed.stdout  # HF did append its summary before train() returned
    compared = compare(generation(example_baseline(tmp_path_factory, "hf-trainer"), "step-00000018"),
                       generation(run, "step-00000018"))
    assert compared.returncode == 0, compared.stdout[-3000:]

    logged = [float(line.split("'loss': '")[1].split("'")[0]) for line in stopped.stdout.splitlines()
              if line.startswith("{'loss': ")]
    digests = (run / "attempts" / attempts(run)[0]["id"] / "step_digests").read_text().split("\n")
    losses = [struct.unpack(">d", bytes.fromhex(line.split()[1].split(":")[0]))[0] for line in digests if line]
    assert len(losses) == len(logged) == 18
    assert all(abs(loss - hf) <= 5e-4 * hf for loss, hf in zip(losses, logged)), (losses, logged)

    report = run_cli("report", run).stdout
    assert "0 samples" not in report
    assert "not tracked: Hugging Face Trainer's data order is its own" in report, report


ACCELERATE_ON_ITS_DEVICE = """
import sys
import torch
from accelerate import Accelerator
from torch import nn
from trainer import recovery
from trainer.recovery import accelerated

recovery.seed_everything(0)
accelerator = Accelerator(cpu=True)
model = nn.Linear(2, 1)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
Accelerator.device = property(lambda self: torch.device("meta"))  # this machine has no accelerator
data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
with recovery.open_run(sys.argv[1]) as run:
    accelerated.load_state(accelerator, run, data=recovery.KeyedData(data, batch_size=4))
    for epoch in run.epochs(1):
        for x, y in accelerated.batches(accelerator, run):
            print("batch on", x.device, y.device)
            run.step(0.0)
"""


def test_accelerate_batches_arrive_on_the_accelerators_device(tmp_path):
    """`accelerated.batches(accelerator, run)` hands the keyed order over on
    `accelerator.device`, as a prepared DataLoader does (`run.batches()` fetches on the CPU,
    issue 47). This machine has no accelerator: the Accelerator's device is `meta` there, a
    device any tensor moves to and none starts on. Cost: ~3 CPU-s (the accelerate import)."""
    script = tmp_path / "on_device.py"
    script.write_text(ACCELERATE_ON_ITS_DEVICE)
    finished = run_cli(script, tmp_path / "run")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.splitlines() == ["batch on meta meta"] * 2


ACCELERATE_NOT_DISTRIBUTED = """
import sys
import torch
from accelerate import Accelerator
from torch import nn
from trainer import recovery
from trainer.recovery import accelerated

with recovery.open_run(sys.argv[1]) as run:
    accelerator = Accelerator()  # on a CPU host under a launcher: one process (DistributedType.NO)
    model = nn.Linear(2, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerated.load_state(accelerator, run, model=model)
    print("trained unsynchronised")
"""


def test_accelerate_that_is_not_distributed_on_a_launched_run_is_refused_in_one_line(tmp_path):
    """A real `Accelerator()` on a CPU host, 2 ranks started as a launcher starts them: Accelerate
    1.16 reports one process and `prepare` returns the plain model, so the ranks would train
    unsynchronised and resume inexactly, silently. `load_state` refuses (2) on every rank, naming
    the fix. Cost: ~1 CPU-s, 6 s of wall (2 forked ranks, each importing accelerate)."""
    script = tmp_path / "not_distributed.py"
    script.write_text(ACCELERATE_NOT_DISTRIBUTED)
    ranks = rank_processes([str(script), str(tmp_path / "run")], 2, expect=2)
    for rank in ranks:
        errors = [line for line in rank.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in rank.stderr and "trained" not in rank.stdout, rank.stderr[-3000:]
        assert "num_processes is 1 but the run has 2 ranks" in errors[0] and "Accelerator(cpu=True)" in errors[0]


def test_lightning_resumed_with_another_accumulate_grad_batches_is_refused_in_one_line(tmp_path, tmp_path_factory):
    """`accumulate_grad_batches` is in the run's fingerprint, as the trainer's --grad-accum is:
    a resume with another value would count positions in other optimizer steps (65)."""
    run = tmp_path / "run"
    shutil.copytree(example_baseline(tmp_path_factory, "lightning"), run)
    refused = run_cli(REPO / "examples" / "lightning_loop.py", run, "--epochs", "4", "--accumulate", "2")
    lines = [line for line in refused.stderr.splitlines() if "error" in line.lower()]
    assert refused.returncode == 65, refused.stderr[-3000:]
    assert len(lines) == 1 and "grad_accum" in lines[0] and "Traceback" not in refused.stderr, refused.stderr[-3000:]
