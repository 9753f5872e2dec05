"""A library user's mistakes (trainer/recovery/run.py, trainer/flags.py): a bad option of
`open_run`, a verb before `restore()` or after the `with` block. Each is one line naming the
problem and the fix, and exit 2, as the command line's usage errors; a bad option writes
nothing. A refusal names options as the library spells them (trainer/recovery/said.py), while
the same error says the command line's flags. In one process, in-process: no child is started.
Cost (TEST_CPU_LOG): 1.4 CPU-s, most of it the one completed run the module shares."""

from __future__ import annotations

import logging
import signal

import pytest
import torch

from trainer import recovery
from trainer.config import CadenceConfig, RunConfig
from trainer.run.fingerprint import FIELDS
from trainer.run.state import Progress


def refusal(caplog, call, status: int = 2) -> str:
    """The one line `call` ends with, after checking its exit status."""
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="trainer"), pytest.raises(SystemExit) as ended:
        call()
    assert ended.value.code == status
    lines = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("options, said", [
    ({"resume": "yes"}, "resume='yes': must be one of 'latest', 'auto' or None"),
    ({"resume": "LATEST"}, "resume='LATEST': must be one of 'latest', 'auto' or None"),
    ({"checkpoint_mode": "fast"}, "checkpoint_mode='fast': must be one of 'auto', 'sync', 'async'"),
    ({"recover": CadenceConfig(every_steps=-5)}, "recover=CadenceConfig(every_steps=-5): must be a positive integer"),
    ({"recover": CadenceConfig(every_s="30")}, "recover=CadenceConfig(every_s='30'): must be a number, got '30' (str)"),
    ({"allow_drift": "world_size"}, "allow_drift='world_size': must be a tuple of names, e.g. allow_drift=('source',)"),
    ({"allow_drift": ("wrld_size",)}, "'wrld_size' is not one of source, dataset,"),
    ({"resum": "auto"}, "open_run() has no option 'resum'; did you mean resume? its options: workload, "),
])
def test_a_bad_option_of_open_run_is_one_line_naming_it_and_exit_2_before_anything_is_written(
        tmp_path, caplog, options, said):
    line = refusal(caplog, lambda: recovery.open_run(tmp_path / "run", **options))
    assert said in line, line
    assert not (tmp_path / "run").exists()


def test_open_runs_options_are_normalised_as_the_command_lines_flags():
    """`every_epochs=0` is off, as `--recover-every-epochs 0`; a repeated drift is named once."""
    from trainer.flags import checked_config  # (imported here: without it, the other tests still say what fails)

    config = checked_config(RunConfig(location=None, recover=CadenceConfig(every_epochs=0, every_steps=2),
                                      allow_drift=["os", "os"], preempt_grace_s=30), FIELDS)
    assert config.recover == CadenceConfig(every_steps=2) and config.allow_drift == ("os",)
    assert config.preempt_grace_s == 30


def model_and_optimizer():
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("verb", ["epochs", "batches", "save", "progress", "step"])
def test_a_verb_before_restore_is_one_line_and_exit_2(tmp_path, caplog, verb):
    calls = {"epochs": lambda run: list(run.epochs(1)), "batches": lambda run: list(run.batches()),
             "save": lambda run: run.save(), "progress": lambda run: run.progress, "step": lambda run: run.step(0.0)}

    def misuse():
        with recovery.open_run(tmp_path / "run") as run:
            calls[verb](run)

    line = refusal(caplog, misuse)
    assert "before restore(): hand over the model and optimizer with restore() first" in line, line


def keyed(batch_size: int = 2) -> recovery.KeyedData:
    return recovery.KeyedData(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=batch_size)


@pytest.fixture(scope="module")
def completed(tmp_path_factory):
    """A run of one epoch, completed, and its run object: (run, its directory)."""
    directory = tmp_path_factory.mktemp("misuse") / "run"
    model, optimizer = model_and_optimizer()
    with recovery.open_run(directory) as run:
        run.restore(model, optimizer, data=keyed())
        for _ in run.epochs(1):
            for (batch,) in run.batches():
                run.step(model(batch).sum())
    return run, directory


def test_after_the_block_the_run_is_closed_but_its_progress_says_where_it_ended(tmp_path, caplog, completed):
    model, optimizer = model_and_optimizer()
    unopened = recovery.open_run(tmp_path / "run")
    assert "restore() outside `with recovery.open_run(...) as run:`" in refusal(
        caplog, lambda: unopened.restore(model, optimizer))
    run, _ = completed
    assert run.progress == Progress(global_step=2, epoch=1, position=0)
    for misuse in (lambda: run.step(0.0), run.save, lambda: list(run.epochs(2))):
        assert "after the `with` block: the run is closed (run.progress still says where it ended)" in \
            refusal(caplog, misuse)


def test_after_the_block_ctrl_c_and_sigterm_are_the_scripts_own_again(tmp_path, caplog):
    """One process: the run's signal handling ends with the block, completed or refused (a
    script's or a notebook's Ctrl-C works after it; before, both signals stayed ignored)."""
    def scripts(signum, frame):
        raise AssertionError("never called")

    before = {stop: signal.signal(stop, scripts) for stop in (signal.SIGINT, signal.SIGTERM)}
    try:
        model, optimizer = model_and_optimizer()
        with recovery.open_run(tmp_path / "run") as run:
            run.restore(model, optimizer, data=keyed())
            for _ in run.epochs(1):
                for (batch,) in run.batches():
                    run.step(model(batch).sum())
        assert [signal.getsignal(stop) for stop in before] == [scripts, scripts]
        refusal(caplog, lambda: recovery.open_run(tmp_path / "run").__enter__(), 73)
        assert [signal.getsignal(stop) for stop in before] == [scripts, scripts]
    finally:
        for stop, handler in before.items():
            signal.signal(stop, handler)


def test_a_refusal_names_open_runs_keywords_where_the_command_line_names_its_flags(tmp_path, caplog, completed):
    _, directory = completed
    model, optimizer = model_and_optimizer()

    def resumed(where, batch_size: int = 2, **options):
        with recovery.open_run(where, **options) as run:
            run.restore(model, optimizer, data=keyed(batch_size))

    assert "choose an empty run directory (open_run's first argument)" in refusal(
        caplog, lambda: resumed(directory), 73)
    assert "continue with resume='latest'" in caplog.records[-1].getMessage()
    assert "accept the change with allow_drift=('config',) (exactness" in refusal(
        caplog, lambda: resumed(directory, batch_size=4, resume="auto"), 65)
    assert "check run directory (open_run's first argument), or start without resume='latest'" in refusal(
        caplog, lambda: resumed(tmp_path / "none", resume="latest"), 66)
    (tmp_path / "file").write_text("")
    assert f"run directory {tmp_path / 'file'} is a file, not a directory" in refusal(
        caplog, lambda: resumed(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    assert "start without resume='latest', or use resume='auto'" in refusal(
        caplog, lambda: resumed(tmp_path / "empty", resume="latest"), 66)


def test_the_same_error_says_the_command_lines_flags_and_the_librarys_keywords():
    """One message, two spellings: `str()` is the command line's line, unchanged."""
    from trainer.config import WorkloadConfig
    from trainer.data.order import EpochShape, uneven_split
    from trainer.errors import UsageError
    from trainer.recovery.said import spelled

    error = UsageError(uneven_split(EpochShape(30, 10, "pad"), 3, WorkloadConfig(batch_size=10).named("batch_size")))
    assert str(error).startswith("--batch-size 10 does not divide evenly across 3 processes")
    assert spelled(error).startswith("KeyedData(batch_size=10) does not divide evenly across 3 processes")
    error = UsageError(uneven_split(EpochShape(32, 12, "refuse"), 3))
    assert "under --last-batch refuse; choose sizes" in str(error)
    assert "under KeyedData(last_batch='refuse'); choose sizes" in spelled(error)


def test_lines_a_library_user_meets_name_open_runs_keywords_not_flags(tmp_path):
    """Issue 57: the lost-peer line, a rejoin that timed out, a local tier of another run and an
    upload that failed named `--resume auto`, `--peer-timeout-secs`, `--local-tier` to a script;
    a tracker's closing line took the command line's text (`exit_status`)."""
    from types import SimpleNamespace

    from trainer.errors import RefuseOverwrite, UsageError, option
    from trainer.layout import STORE_MARKER, RunDirectory
    from trainer.parallel.ranks import Ranks
    from trainer.recovery.run import exit_status
    from trainer.recovery.said import spelled
    from trainer.storage.object.tiering import RemoteRun, _as_failure

    lost = Ranks.peer_failure(SimpleNamespace(_bound_s=5.0, group=None, heartbeat=None),
                              RuntimeError("Connection closed by peer"), "stepping")
    ours = spelled(lost).replace("torchrun --max-restarts", "")  # torchrun's own flag stays
    assert "--resume auto" in str(lost) and "resume='auto'" in ours and "--" not in ours
    slow = Ranks.peer_failure(SimpleNamespace(_bound_s=5.0, group=None, heartbeat=None),
                              RuntimeError("timed out"), "stepping")
    assert "resume='auto'" in spelled(slow) and "--" not in spelled(slow).replace("torchrun --max-restarts", "")

    tier = tmp_path / "tier"
    tier.mkdir()
    (tier / STORE_MARKER).write_text("s3://bucket/other\n")
    with pytest.raises(RefuseOverwrite) as refused:
        RemoteRun(SimpleNamespace(url="s3://bucket/run"), RunDirectory(tier)).adopt_local_tier()
    said = spelled(refused.value)
    assert str(refused.value).startswith(f"--local-tier {tier} is the local tier of s3://bucket/other")
    assert said.startswith(f"local tier {tier} is the local tier of s3://bucket/other") and "--" not in said, said
    assert "TRAINER_LOCAL_TIER" in said
    assert "resume='auto'" in spelled(_as_failure(RuntimeError("boom"), "s3://bucket/run"))

    status, closing = exit_status(UsageError(f"give {option('--resume', 'auto')}"))
    assert (status, closing) == (2, "give resume='auto'")


@pytest.mark.parametrize("settings, said", [
    ({"batch_size": -1}, "KeyedData(batch_size=-1): must be a positive integer, got -1"),
    ({"grad_accum": 0}, "KeyedData(grad_accum=0): must be a positive integer, got 0"),
    ({"num_workers": -2}, "KeyedData(num_workers=-2): must be 0 or more, got -2"),
])
def test_keyed_datas_settings_are_checked_in_one_line_and_exit_2(caplog, settings, said):
    """Issue 57: `KeyedData(batch_size=-1)` was taken as given (an epoch of -10 batches)."""
    dataset = torch.utils.data.TensorDataset(torch.ones(4, 2))
    assert refusal(caplog, lambda: recovery.KeyedData(dataset, **settings)) == f"trainer: error: {said}"
    line = refusal(caplog, lambda: recovery.KeyedData(42))  # neither map-style nor a stream
    assert line.startswith("trainer: error: KeyedData: build_dataset returned a int") and "--" not in line, line


def test_a_final_save_that_raises_leaves_a_record_that_says_failed(tmp_path, caplog):
    """Issue 57: the `with` block's end saves the final generation; when that raised, the
    attempt's record stayed `running` (read later as a killed attempt, a crash-loop count)."""
    import json

    class Failing:
        armed = False

        def state_dict(self) -> dict:
            if self.armed:
                raise RuntimeError("no state today")
            return {"count": torch.zeros(1)}

        def load_state_dict(self, stored: dict) -> None:
            pass

    failing, (model, optimizer) = Failing(), model_and_optimizer()
    with caplog.at_level(logging.ERROR, logger="trainer"), pytest.raises((SystemExit, RuntimeError)):
        with recovery.open_run(tmp_path / "run") as run:
            run.restore(model, optimizer, extras={"failing": failing})
            failing.armed = True  # the final save, at the end of the block, raises
    (record,) = [json.loads(path.read_text()) for path in (tmp_path / "run" / "attempts").glob("*/attempt.json")]
    assert record["status"] == "failed" and "no state today" in record["reason"], record
