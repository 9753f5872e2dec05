"""`--recover-every-secs auto` end to end: the interval follows what the run measures, each
change is one log line and an entry of the attempt record, and it never changes what is
trained: a run killed at an unplanned moment and resumed with other bounds ends bit-identical
to the uninterrupted baseline. The policy and the formulas are unit-tested in test_cadence.py.

Cost: three trainer processes (~3 s each on a quiet machine) and two usage checks."""

from __future__ import annotations

from support.cli import compare, one_error_line, run_cli, start, train, wait_for_line
from support.runs import attempts, generation

AUTO = ("--recover-every-epochs", 0, "--recover-every-secs", "auto", "--recover-auto-min-secs", 0.02)


def test_auto_cadence_adapts_and_a_killed_run_resumes_bit_identical(tmp_path, baseline):
    run = tmp_path / "run"
    process = start(run, *AUTO, "--assume-mtbf-secs", 1)
    wait_for_line(process, "step=30 ")
    process.kill()  # kill -9 wherever it stands, between or during saves
    process.wait()
    # a second attempt with other bounds: cadence is not fingerprinted, so this resumes
    second = train(run, "--resume", *AUTO, "--recover-auto-max-secs", 0.05, "--interrupt-at-step", 50, expect=75)
    assert "cadence auto: recovery every" in second.stdout
    resumed = train(run, "--resume", *AUTO)
    result = compare(generation(baseline), generation(run))
    assert result.returncode == 0, result.stdout

    records = attempts(run)
    first, later = records[0], records[1:]
    assert first["cadence_changes"][0]["cost_s"] is None  # started at the lower bound, nothing measured
    assert first["cadence_changes"][0]["interval_s"] == 0.02
    assert first["cadence_changes"][0]["mtbf_from"].startswith("assumed")
    assert all(0.02 <= change["interval_s"] <= 0.05 for change in records[1]["cadence_changes"])
    # the third attempt plans with the history: two failures (a kill -9 and an interrupt)
    assert records[2]["cadence_changes"][0]["failures"] == 2
    assert records[2]["cadence_changes"][0]["cost_from"] == "earlier attempts"
    lines = [line for line in resumed.stdout.splitlines() if line.startswith("cadence auto:")]
    assert len(lines) == len(records[2]["cadence_changes"])  # one line per change, each recorded
    steps = [entry["step"] for record in later for entry in record["generations_published"]]
    assert any(step % 8 for step in steps)  # saved by time, not at epoch ends
    assert all(record["progress"]["points"] for record in records)  # coarse step times recorded


def test_auto_options_are_checked_in_one_line():
    alone = run_cli("--output", "unused", "--recover-auto-min-secs", 5)
    assert alone.returncode == 2 and "--recover-auto-min-secs applies only with --recover-every-secs auto; add it, or drop it" in one_error_line(alone)
    inverted = run_cli("--output", "unused", "--recover-every-secs", "auto", "--recover-auto-min-secs", 60,
                       "--recover-auto-max-secs", 10)
    assert inverted.returncode == 2 and "above --recover-auto-max-secs 10" in one_error_line(inverted)
