"""`--workload MODULE:FACTORY`: a user's module outside the trainer package, with its own
options (in --help and in the fingerprint), its source in `source`, batches of any
structure, an after-backward hook, extra state saved and compared, and the silent failures
of issue #13 made loud or impossible, end to end through the real CLI."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from support.cli import REPO, compare, one_error_line, run_cli, train
from support.runs import attempts, generation, made_once

TOY = "tests/workloads/toy.py:ToyWorkload"
EDGE = ("--workload", "tests/workloads/edge_cases.py:EdgeCase", "--epochs", 3, "--batch-size", 8)
RUN = ("--workload", TOY, "--epochs", 3, "--batch-size", 8)  # 3 batches per epoch, 9 steps
FINAL = "step-00000009"


def manifest(output, name=FINAL) -> dict:
    return json.loads((generation(output, name) / "manifest.json").read_text())


@pytest.fixture(scope="module")
def toy_baseline(tmp_path_factory):
    return made_once(tmp_path_factory, "toy", lambda folder: train(folder / "run", *RUN, "--num-workers", 1)) / "run"


def test_the_workloads_options_are_listed_and_parsed():
    shown = run_cli("--workload", TOY, "--help")
    assert shown.returncode == 0 and "--width" in shown.stdout and "--toy-lr" in shown.stdout
    # an option declared without help= still shows its default
    assert re.search(r"--width WIDTH\s+\(default: 8\)", shown.stdout), shown.stdout[-1500:]
    assert "--hidden-size" not in shown.stdout  # the default workload's options are not the toy's
    assert "--hidden-size" in run_cli("--help").stdout
    wrong = run_cli("--output", "unused", "--workload", TOY, "--width", "0")
    assert wrong.returncode == 2 and "--width" in one_error_line(wrong)


def test_fingerprint_holds_the_workload_its_options_and_its_source(toy_baseline):
    fingerprint = manifest(toy_baseline)["fingerprint"]
    assert fingerprint["config"] == {"amp": False, "batch_size": 8, "features": 4, "optimizer": "sgd",
                                     "seed": 1234, "threads": 1, "toy_lr": 0.05, "toy_samples": 24, "width": 8,
                                     "workload": TOY, "gradient_reduction": "fixed-buckets"}
    assert fingerprint["dataset"] == "unfingerprinted:toy.NoisyRegression:len=24"  # no fingerprint(): documented
    config = json.loads((toy_baseline / "exports" / FINAL / "config.json").read_text())
    assert config["architecture"] == "toy-mlp" and config["width"] == 8


def test_resume_mid_epoch_with_other_worker_counts_equals_the_baseline(tmp_path, toy_baseline):
    """Global-RNG augmentation in the dataset, fetched by 2 workers, then by the main process,
    against a baseline fetched by 1 worker (issue #13, silent failure 1)."""
    run = tmp_path / "run"
    train(run, *RUN, "--num-workers", 2, "--recover-every-steps", 2, "--interrupt-at-step", 5, expect=75)
    resumed = train(run, *RUN, "--resume", "--num-workers", 0)
    assert "restored step-00000004 (step=4 epoch=1 position=1)" in resumed.stdout
    result = compare(generation(toy_baseline, FINAL), generation(run, FINAL), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    fields = {f["field"]: f["equal"] for f in json.loads(result.stdout)["fields"]}
    assert fields["workload.counter.steps"] and fields["workload.counter.norm"]  # extra state compared


def test_a_changed_option_or_workload_source_is_refused(tmp_path):
    run = tmp_path / "run"
    source = tmp_path / "mine" / "toy_copy.py"
    source.parent.mkdir()
    shutil.copy(REPO / "tests" / "workloads" / "toy.py", source)
    mine = ("--workload", f"{source}:ToyWorkload", "--epochs", 2, "--batch-size", 8)
    train(run, *mine, "--interrupt-at-step", 4, expect=75)
    drift = run_cli("--output", run, *mine, "--resume", "--width", 9)
    assert drift.returncode == 65 and "config.width 8 → 9" in one_error_line(drift)
    source.write_text(source.read_text().replace("nn.Dropout(0.1)", "nn.Dropout(0.2)"))
    edited = run_cli("--output", run, *mine, "--resume")
    assert edited.returncode == 65 and "source" in one_error_line(edited)


def test_an_optimizer_with_lazily_created_state_is_refused_not_restored_fresh(tmp_path):
    """Issue #13, silent failure 2: the restore left the optimizer state unread; now exit 65."""
    run = tmp_path / "run"
    lazy = (*RUN, "--optimizer", "accumulating")
    train(run, *lazy, "--interrupt-at-step", 7, expect=75)
    refused = run_cli("--output", run, *lazy, "--resume")
    assert refused.returncode == 65
    line = one_error_line(refused)
    assert "4 stored entries" in line and "optim.state.0.weight.momentum_buffer" in line and "lazily" in line
    assert attempts(run)[-1]["status"] == "refused"


@pytest.mark.parametrize("spec, says", [
    ("no_such_module:Factory", "cannot import no_such_module"),
    ("tests/workloads/toy.py:NoSuchFactory", "has no callable 'NoSuchFactory'"),
    ("tests/workloads/toy.py", "give MODULE:FACTORY"),
    ("tests/workloads/missing.py:ToyWorkload", "no such file"),
])
def test_a_workload_that_cannot_be_loaded_is_one_line_and_exit_2(tmp_path, spec, says):
    result = run_cli("--output", tmp_path / "run", "--workload", spec)
    assert result.returncode == 2 and says in one_error_line(result)
    assert not (tmp_path / "run").exists()


def test_a_workload_option_that_shadows_the_trainers_is_refused(tmp_path):
    module = tmp_path / "shadowing.py"
    module.write_text("class Shadowing:\n    @staticmethod\n    def add_options(group):\n"
                      "        group.add_argument('--epochs', type=int, default=1)\n")
    result = run_cli("--output", tmp_path / "run", "--workload", f"{module}:Shadowing")
    assert result.returncode == 2 and "--epochs" in one_error_line(result)


def test_source_covers_the_workloads_whole_package_or_its_module(tmp_path, monkeypatch):
    from trainer.config import DEFAULT_WORKLOAD
    from trainer.run.fingerprint import source_digest
    from trainer.workload.loading import find_factory

    (tmp_path / "mypkg" / "models").mkdir(parents=True)
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "models" / "__init__.py").write_text("WIDTH = 8\n")
    (tmp_path / "mypkg" / "factory.py").write_text("class Factory:\n    pass\n")
    (tmp_path / "lone").mkdir()  # apart from mypkg: a lone module's source includes what is imported below it
    (tmp_path / "lone" / "single.py").write_text("class Factory:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path / "lone"))
    packaged = find_factory("mypkg.factory:Factory").source_files()
    assert packaged == ((tmp_path / "mypkg").resolve(),)
    (tmp_path / "lone" / "helpers.py").write_text("CLIP = 1.0\n")  # a helper beside a lone module
    lone = find_factory("single:Factory").source_files()
    assert lone == ((tmp_path / "lone" / "helpers.py").resolve(), (tmp_path / "lone" / "single.py").resolve())
    before_helper = source_digest(workload=lone)
    (tmp_path / "lone" / "helpers.py").write_text("CLIP = 0.01\n")
    assert source_digest(workload=lone) != before_helper
    assert find_factory(DEFAULT_WORKLOAD).source_files() == ()  # inside the trainer: its digest alone
    before = source_digest(workload=packaged)
    assert before != source_digest()
    (tmp_path / "mypkg" / "models" / "__init__.py").write_text("WIDTH = 9\n")  # a sibling module changed
    assert source_digest(workload=packaged) != before


def test_a_factory_that_returns_no_workload_is_one_line_and_exit_2(tmp_path):
    """A factory returning None, or a class that is not a workload (the dataset, by a typo),
    is refused before the output is touched, naming what is missing."""
    module = tmp_path / "wrong.py"
    module.write_text("def returns_none(options):\n    return None\n\n"
                      "class NotAWorkload:\n    def __init__(self, options):\n        pass\n"
                      "    def build_model(self):\n        pass\n")
    for factory, lacks in (("returns_none", "NoneType, which lacks build_dataset"),
                           ("NotAWorkload", "NotAWorkload, which lacks build_dataset, build_optimizer")):
        result = run_cli("--output", tmp_path / "run", "--workload", f"{module}:{factory}")
        line = one_error_line(result)
        assert result.returncode == 2 and lacks in line and "trainer/workload/protocol.py" in line, line
    assert not (tmp_path / "run").exists()


def test_an_accepted_config_drift_without_adopt_config_is_said(tmp_path):
    """The toy has no adopt_config: an allowed --toy-lr change cannot reach the restored
    optimizer, and the run says so instead of silently keeping the old rate."""
    run = tmp_path / "run"
    train(run, *RUN, "--interrupt-at-step", 4, expect=75)
    resumed = train(run, *RUN, "--toy-lr", "0.01", "--resume", "--allow-drift", "config")
    assert "config drift accepted, but the workload has no adopt_config" in resumed.stdout


def test_the_cnn_example_refuses_a_run_longer_than_its_schedule(tmp_path):
    result = run_cli("--output", tmp_path / "run", "--workload", "examples/small_cnn.py:SmallCNN", "--epochs", "30")
    assert result.returncode == 2 and "--cnn-total-steps 64" in one_error_line(result)
    assert not (tmp_path / "run").exists()


def test_workload_mistakes_before_training_are_one_line_and_exit_2(tmp_path):
    """Issue #24: an optimizer holding a tensor that is not a model parameter is refused
    before the first step (it used to train, then crash at the first save and lose it all);
    a factory that raises, a missing dependency and a misspelt option say what is wrong."""
    foreign = run_cli("--output", tmp_path / "foreign", *EDGE, "--case", "foreign-tensor")
    line = one_error_line(foreign)
    assert foreign.returncode == 2 and "not parameters of the model" in line and "nn.Parameter" in line, line
    assert not list((tmp_path / "foreign").glob("checkpoints/step-*"))
    raising = run_cli("--output", tmp_path / "raising", *EDGE, "--case", "raising-factory")
    line = one_error_line(raising)
    assert raising.returncode == 2 and "its factory failed: ValueError: bad --width 8" in line, line
    assert not (tmp_path / "raising").exists()
    (tmp_path / "needs_dep.py").write_text("import no_such_dependency_24\n\nclass W:\n    pass\n")
    missing = run_cli("--output", tmp_path / "dep", "--workload", f"{tmp_path / 'needs_dep.py'}:W")
    line = one_error_line(missing)
    assert missing.returncode == 2 and "imports 'no_such_dependency_24', which is not installed" in line, line
    assert "run from the directory" not in line
    misspelt = run_cli("--output", tmp_path / "typo", *EDGE, "--widht", 3)
    assert misspelt.returncode == 2 and "--workload tests/workloads/edge_cases.py:EdgeCase --help" in \
        one_error_line(misspelt)


CLASHING = """
class ReaderWorkload:
    @staticmethod
    def add_options(group):
        group.add_argument("--shuffle-buffer", type=int, default=8)  # declared before the trainer had it


class Twice:
    @staticmethod
    def add_options(group):
        group.add_argument("--twice-width", type=int, default=8)
        group.add_argument("--twice-width", type=int, default=9)
"""


def test_a_workload_option_the_trainer_also_defines_says_so_and_how_to_rename_it(tmp_path):
    """Issue #43: a workload that declared `--shuffle-buffer` before the trainer had one: one
    line naming the clash and the rename (the naming rule's page), exit 2; an option the
    workload itself declares twice is said to be that. ~1 s."""
    (tmp_path / "clashing.py").write_text(CLASHING)
    clash = run_cli("--output", tmp_path / "run", "--workload", f"{tmp_path / 'clashing.py'}:ReaderWorkload")
    assert clash.returncode == 2 and one_error_line(clash).endswith(
        "declares --shuffle-buffer, which the trainer itself defines (python -m trainer --help); rename the "
        "workload's option: give each of its options a prefix of its own, e.g. --reader-shuffle-buffer "
        "(docs/workload-options.md)"), clash.stderr
    twice = run_cli("--output", tmp_path / "run", "--workload", f"{tmp_path / 'clashing.py'}:Twice")
    assert twice.returncode == 2 and one_error_line(twice).endswith("declares --twice-width twice in its add_options")
    assert not (tmp_path / "run").exists()


def reserved_words() -> set[str]:
    """The words the trainer keeps its options under, as docs/workload-options.md lists them."""
    page = (REPO / "docs" / "workload-options.md").read_text()
    return set(page.split("<!-- trainer-words:", 1)[1].split("`")[1].split())


def test_trainer_options_keep_to_their_words_and_example_options_to_a_prefix_of_their_own():
    """docs/workload-options.md's rule, both sides: every trainer option starts with a reserved
    word (a new word is a contract change: add it to the page), and each example's options
    share one prefix that is none of them, so no future trainer option can meet them. In
    process, ~0.1 s."""
    from trainer.cli import trainer_parser

    words = reserved_words()
    unreserved = sorted(option for action in trainer_parser()._actions for option in action.option_strings
                        if option.startswith("--") and option[2:].removeprefix("no-").split("-")[0] not in words)
    assert not unreserved, f"trainer options under a word docs/workload-options.md does not reserve: {unreserved}"
    workloads = [path for path in sorted((REPO / "examples").glob("*.py")) if "def add_options" in path.read_text()]
    assert len(workloads) >= 5  # the scripts of your own loop (docs/library.md) parse their own argv: not workloads
    for example in workloads:
        declared = re.findall(r"add_argument\(\s*\"--([a-z0-9-]+)\"", example.read_text())
        prefixes = {name.split("-")[0] for name in declared}
        assert len(prefixes) <= 1 and not prefixes & words and all("-" in name for name in declared), \
            f"{example.name}: {declared}"


def test_a_parameter_the_optimizer_does_not_cover_trains_and_resumes_exactly(tmp_path):
    """Legal: the head stays fixed. Its gradients are cleared every step (they used to pile
    up across steps, which a resumed process could not repeat)."""
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    train(baseline, *EDGE, "--case", "uncovered")
    train(run, *EDGE, "--case", "uncovered", "--recover-every-steps", 2, "--interrupt-at-step", 5, expect=75)
    train(run, *EDGE, "--case", "uncovered", "--resume")
    result = compare(generation(baseline, FINAL), generation(run, FINAL))
    assert result.returncode == 0, result.stdout


def test_an_extra_state_tensor_shaped_at_the_first_step_is_named_at_restore(tmp_path):
    run = tmp_path / "run"
    train(run, *EDGE, "--case", "lazy-extra", "--recover-every-steps", 2, "--interrupt-at-step", 5, expect=75)
    refused = run_cli("--output", run, *EDGE, "--case", "lazy-extra", "--resume")
    line = one_error_line(refused)
    assert refused.returncode == 65 and "stateful() extra 'average'" in line and "build_model" in line, line
    assert "drift" not in line


def test_a_workload_by_path_imports_its_helpers_and_an_edited_one_is_refused(tmp_path):
    """Issue #24: `--workload ../proj/my_workload.py:Mine` imports `my_helpers` beside it and
    `helpers/my_helpers.py` below it (as `python file.py` would); an edit to the one in the
    sub-package between attempts is refused (65) naming that file."""
    project = tmp_path / "proj"
    (project / "helpers").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "workloads" / "toy.py", project / "my_helpers.py")
    (project / "helpers" / "my_helpers.py").write_text("DECAY = 0.9\n")
    (project / "my_workload.py").write_text(
        "import torch\n\nfrom helpers import my_helpers as schedule\nfrom my_helpers import ToyWorkload\n\n\n"
        "class Mine(ToyWorkload):\n    def build_scheduler(self, optimizer):\n"
        "        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.DECAY ** step)\n")
    run, mine = tmp_path / "run", ("--workload", f"{project / 'my_workload.py'}:Mine", "--epochs", 2)
    train(run, *mine, "--interrupt-at-step", 4, expect=75)
    (project / "helpers" / "my_helpers.py").write_text("DECAY = 0.8\n")
    refused = run_cli("--output", run, *mine, "--resume")
    line = one_error_line(refused)
    assert refused.returncode == 65 and "changed workload/helpers/my_helpers.py" in line, line
