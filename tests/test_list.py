"""`python -m trainer list`: generations, exports and attempts of a real interrupted run."""

from __future__ import annotations

import json

from support.cli import one_error_line, run_cli, train


def test_list_shows_an_interrupted_and_resumed_run(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 3, "--interrupt-at-step", 11, expect=75)
    train(run, "--epochs", 3, "--resume")
    table = run_cli("list", run)
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    rows = [line.split() for line in lines if line.startswith("  step-")]
    assert [r[0] for r in rows] == ["step-00000008", "step-00000016", "step-00000024", "step-00000024"]
    assert [r[4] for r in rows[:3]] + [rows[3][3]] == ["yes"] * 4  # generations, then the export
    attempt_rows = [line.split() for line in lines if line.startswith("  2")]
    assert [(r[1], r[2]) for r in attempt_rows] == [("interrupted", "75"), ("completed", "0")]
    assert attempt_rows[1][3:7] == ["step-00000008", "3", "0", "24"]  # restored, replayed, abandoned, last

    described = json.loads(run_cli("list", run, "--json").stdout)
    assert [g["name"] for g in described["generations"]] == ["step-00000008", "step-00000016", "step-00000024"]
    assert all(g["verified"] and g["save_s"] > 0 for g in described["generations"])
    assert described["generations"][0]["attempt"] == described["attempts"][0]["id"]
    assert described["exports"][0]["name"] == "step-00000024"
    assert described["attempts"][1]["steps_replayed"] == 3


def test_list_of_a_missing_directory_is_one_line(tmp_path):
    result = run_cli("list", tmp_path / "nope")
    assert result.returncode == 66 and "does not exist; pass the --output of a run" in result.stderr


def test_list_or_report_of_a_folder_that_is_not_a_run_names_the_runs_beneath(tmp_path):
    """`list outputs` used to print empty tables and exit 0 (issue #24)."""
    outputs = tmp_path / "outputs"
    (outputs / "a" / "attempts").mkdir(parents=True)  # what a run directory holds once a trainer started
    (outputs / "nested" / "b" / "checkpoints").mkdir(parents=True)
    (outputs / "a" / "attempts" / "x").mkdir()
    for command in ("list", "report"):
        result = run_cli(command, outputs)
        line = one_error_line(result)
        assert result.returncode == 66 and f"runs beneath it: {outputs / 'a'}, {outputs / 'nested' / 'b'}" in line, line
    empty = run_cli("list", outputs / "nested" / "b" / "checkpoints" / "..")  # a run's own folder still lists
    assert empty.returncode == 0, empty.stderr
    none = run_cli("list", tmp_path / "outputs" / "a" / "attempts" / "x")
    assert none.returncode == 66 and "holds none" in one_error_line(none)


def test_a_store_url_without_its_package_names_the_package_not_output():
    result = run_cli("list", "gs://bucket/run")
    line = one_error_line(result)
    assert result.returncode == 2 and "gcsfs" in line and "--output" not in line, line


def test_a_foreign_attempt_record_is_ignored_by_list_and_resume(tmp_path):
    run = tmp_path / "run"
    train(run, "--epochs", 2, "--interrupt-at-step", 10, expect=75)
    good = next((run / "attempts").iterdir()) / "attempt.json"
    odd_wall = {**json.loads(good.read_text()), "wall_s": "n/a"}
    for name, text in {"zz-list": "[]", "zz-types": '{"id": 5, "status": "running", "restored": "step-8"}',
                       "zz-wall": json.dumps(odd_wall)}.items():
        (run / "attempts" / name).mkdir()
        (run / "attempts" / name / "attempt.json").write_text(text)
    table = run_cli("list", run)
    assert table.returncode == 0 and "Traceback" not in table.stderr
    assert [line.split()[1] for line in table.stdout.splitlines() if line.startswith("  2")] == ["interrupted"]
    resumed = train(run, "--epochs", 2, "--resume")
    assert "ignoring" in resumed.stdout and "not an attempt record this trainer wrote" in resumed.stdout
