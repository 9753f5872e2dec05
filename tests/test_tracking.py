"""`--tracked` in Polyaxon's offline mode: the local analogue of a managed run and `ops resume`.

Reopening the same offline run (same POLYAXON_RUN_INSTANCE) after an exit 75 is what
`polyaxon ops resume` does on a cluster: same run uuid, same outputs path, the metric history
kept. What offline tracking wrote is read back from its files.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import pytest

from support.cli import compare, one_error_line, run_cli
from support.runs import attempts, generation, png_size

from trainer.errors import TrackingUnavailable
from trainer.inspect.timeline import DASHBOARD
from trainer.integrations.polyaxon.tracked_run import parse_run_instance
from trainer.integrations.polyaxon.tracking import PolyaxonEvents, cloning_kind


def offline_env(root: Path, run_uuid: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYAXON_")}
    env.update(HOME=str(root / "home"), POLYAXON_IS_OFFLINE="true", POLYAXON_OFFLINE_ROOT=str(root / "offline"),
               POLYAXON_TRACKING_FLUSH_DELAY="0")
    if run_uuid:
        env["POLYAXON_RUN_INSTANCE"] = f"local.training-recovery.runs.{run_uuid}"
    return env


def tracked(env: dict, *args, expect: int):
    result = run_cli("--tracked", *args, env=env)
    assert result.returncode == expect, f"exit {result.returncode}, wanted {expect}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def offline_run(root: Path, run_uuid: str) -> tuple[Path, dict]:
    folder = root / "offline" / "runs" / run_uuid
    return folder, json.loads((folder / "run.plx.json").read_text())


def logged_steps(folder: Path, metric: str) -> list[tuple[int, float]]:
    lines = (folder / "events" / "metric" / f"{metric}.plx").read_text().splitlines()
    assert lines[0] == "step|timestamp|metric"
    return [(int(step), float(value)) for step, _, value in (line.split("|") for line in lines[1:])]


def test_offline_tracked_run_interrupted_and_resumed_in_the_same_run_matches_baseline(tmp_path, baseline):
    run_uuid = uuid.uuid4().hex
    env = offline_env(tmp_path, run_uuid)
    first = tracked(env, "--interrupt-at-step", 27, expect=75)
    folder, record = offline_run(tmp_path, run_uuid)
    outputs = folder / "outputs"
    assert f"outputs {outputs}" in first.stdout
    assert record["status"] == "stopped"  # not "succeeded": offline closes a run as succeeded by default
    # the stopped status says what a resume restores and the command that continues the run
    stopped = record["status_conditions"][-1]
    assert stopped["reason"] == "Exit75" and stopped["message"] == (
        f"interrupted or preempted (exit 75); resumable from newest generation step-00000024; to continue, "
        f"run `polyaxon ops resume -uid {run_uuid} -f presets/resume.yaml`")
    assert first.stderr.strip().endswith(f"to continue, run `polyaxon ops resume -uid {run_uuid} -f presets/resume.yaml`")
    assert record["name"] == "original-1-attempt"

    tracked(env, "--resume", expect=0)
    folder, record = offline_run(tmp_path, run_uuid)
    assert [c["type"] for c in record["status_conditions"]][-3:] == ["resuming", "running", "succeeded"]
    result = compare(generation(baseline), generation(outputs))
    assert result.returncode == 0 and "all equal" in result.stdout, result.stdout

    # Metrics at the global step: the resumed attempt appended 28..64 and did not log its replay
    # of 25..27 again; every value equals the uninterrupted baseline's.
    baseline_history = json.loads(next((baseline / "attempts").glob("*/summary.json")).read_text())["history"]
    for metric in ("loss", "lr"):
        steps = logged_steps(folder, metric)
        assert [s for s, _ in steps] == list(range(1, 65))
        assert [v for _, v in steps] == baseline_history[metric]

    # Attempt facts as outputs; the attempt records name the Polyaxon run and how it was cloned.
    assert record["outputs"]["restored_generation"] == "step-00000024"
    assert record["outputs"]["restored_step"] == 24 and record["outputs"]["steps_replayed"] == 3
    identities = [a["polyaxon"] for a in attempts(outputs)]
    assert [i["run_uuid"] for i in identities] == [run_uuid, run_uuid]
    assert [i["cloning"] for i in identities] == [None, "resume"]

    # Lineage: the generations and the export that still exist, carrying our manifest digest.
    # Retention (keep_last 3; the restored step 24 is protected) deleted the others in both
    # attempts, and their references went with them.
    lineage = {a["name"]: a for a in json.loads((folder / "lineages.plx.json").read_text())}
    final = lineage["generation-step-00000064"]
    assert final["kind"] == "dir"
    manifest = outputs / "checkpoints" / "step-00000064" / "manifest.json"
    assert final["summary"]["hash"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert lineage["export-step-00000064"]["kind"] == "model"
    live = {f"generation-{g.name}" for g in (outputs / "checkpoints").glob("step-*")}
    assert live == {f"generation-step-{s:08d}" for s in (24, 48, 56, 64)}
    assert {name for name in lineage if name.startswith("generation-")} == live

    # The outputs the polyaxonfiles declare for pipelines.
    assert record["outputs"]["newest_generation"] == "step-00000064"
    assert record["outputs"]["export_path"] == "exports/step-00000064"
    assert record["outputs"]["final_loss"] == baseline_history["loss"][-1]

    # The recovery report at the end of each attempt: the timeline as an image (at step 0, the
    # whole run so far, replaced by each attempt: Polyaxon's image widget opens on the lowest
    # step; and at the attempt's last step, its own) and the run's totals as outputs.
    images = [json.loads(line.split("|", 2)[2])["path"]
              for line in (folder / "events" / "image" / "recovery-timeline.plx").read_text().splitlines()[1:]]
    assert images == [f"assets/image/recovery-timeline_{step}.png" for step in (0, 27, 0, 64)]
    assert all(png_size(folder / image) == (DASHBOARD.width, DASHBOARD.height) for image in images)
    assert (folder / images[0]).read_bytes() == (folder / images[-1]).read_bytes() != (folder / images[1]).read_bytes()
    assert lineage["recovery-timeline"]["summary"]["step"]["min"] == 0  # the step the widget opens on
    outputs = record["outputs"]
    assert (outputs["attempts"], outputs["useful_steps"], outputs["computed_steps"]) == (2, 64, 27 + 64 - 24)
    assert (outputs["replayed_steps"], outputs["lost_steps"]) == (3, 3)
    assert outputs["goodput_steps_pct"] == round(100 * 64 / 67, 1) == 95.5
    assert 0 < outputs["goodput_time_pct"] < 100 and 0 < outputs["checkpoint_overhead_pct"] < 100
    assert record["name"] == "resumed-2-attempts"
    assert outputs["first_params"] == ""  # offline: no inputs (managed: the live tests)


def test_plain_restart_has_nothing_to_resume_and_says_how_to_continue(tmp_path):
    run_uuid = uuid.uuid4().hex  # a plain `ops restart`: a new run with empty outputs
    result = tracked(offline_env(tmp_path, run_uuid), "--resume", expect=66)
    line = one_error_line(result)
    assert "nothing to resume" in line and "ops restart" in line and "--copy" in line
    assert offline_run(tmp_path, run_uuid)[1]["status"] == "failed"


def test_offline_resume_without_a_run_instance_is_refused_before_any_run_is_made(tmp_path):
    env = offline_env(tmp_path)
    assert "POLYAXON_RUN_INSTANCE" not in env
    line = one_error_line(tracked(env, "--resume", expect=2))
    assert line.endswith("--resume with offline tracking continues an existing offline run: set "
                         "POLYAXON_RUN_INSTANCE=owner.project.runs.UUID (its folder is $POLYAXON_OFFLINE_ROOT/runs/"
                         "UUID); without it every process is a new, empty run"), line
    assert "ops restart" not in line
    assert not list((tmp_path / "offline").glob("runs/*")), "an empty offline run was left behind"


def test_tracked_refuses_when_tracking_cannot_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYAXON_")}
    env["HOME"] = str(tmp_path)
    line = one_error_line(tracked(env, expect=2))
    assert "POLYAXON_IS_OFFLINE=true" in line
    line = one_error_line(tracked(offline_env(tmp_path), "--output", tmp_path / "run", expect=2))
    assert "--output and --tracked are exclusive" in line
    assert not (tmp_path / "run").exists()


def test_run_names_are_slugs_the_server_accepts():
    import re

    from trainer.integrations.polyaxon.tracking import run_name

    u = "a" * 32
    names = [run_name(None, None), run_name("resume", None, 2), run_name("copy", u, 1), run_name("restart", u, 3)]
    assert names == ["original", "resumed-2-attempts", f"copy-of-{u}-1-attempt", f"restart-of-{u}-3-attempts"]
    assert all(re.fullmatch(r"[-a-zA-Z0-9_]{1,128}", name) for name in names)  # haupt's validate_slug


def test_cloning_kind_tells_resume_copy_restart_and_fresh_apart():
    same = {"run_uuid": "u1"}  # the previous attempt's `polyaxon`
    assert cloning_kind(None, "u1", same) == "resume"
    assert cloning_kind(None, "u2", same) is None
    assert cloning_kind(None, "u1", {}) is None
    assert cloning_kind("copy", "u2", same) == "copy"
    assert cloning_kind("restart", "u2", {}) == "restart"


def test_run_instance_is_parsed_or_refused():
    assert parse_run_instance("acme.mnist.runs.abc") == ("acme", "mnist", "abc")
    with pytest.raises(TrackingUnavailable):
        parse_run_instance("acme.mnist.abc")


class BrokenRun:
    """A Polyaxon run whose image logging fails."""

    run_uuid = "u1"

    def __init__(self, outputs: Path):
        self.outputs = outputs
        self.statuses = []

    def get_outputs_path(self) -> str:
        return str(self.outputs)

    def log_image(self, **kwargs):
        raise RuntimeError("artifacts store unreachable")

    def log_succeeded(self, message):
        self.statuses.append("succeeded")


def test_a_failing_report_hook_is_a_warning_and_the_status_is_still_logged(tmp_path, caplog):
    record = {"id": "a1", "status": "completed", "exit_code": 0, "restored": None, "last_step": 8, "first_step": 0,
              "steps_replayed": None, "wall_s": 1.0, "reason": None, "started_utc": "2026-01-01T00:00:00+00:00",
              "generations_published": [], "exports_published": []}
    (tmp_path / "attempts" / "a1").mkdir(parents=True)
    (tmp_path / "attempts" / "a1" / "attempt.json").write_text(json.dumps(record))
    run = BrokenRun(tmp_path)
    PolyaxonEvents(run, "offline", None).close(0, None)
    assert run.statuses == ["succeeded"]
    assert "could not log the recovery report of run u1: RuntimeError: artifacts store unreachable" in caplog.text
