"""`python -m trainer report`: numbers derived from attempt records, the timeline PNG.

The pure computation is checked on hand-built records; the command on one real run with a
known history (an interrupt, a kill -9 after a known step, a refused start, a preemption,
then completion), whose expected numbers are derived here from that history."""

from __future__ import annotations

import json
import signal

import pytest

from support.cli import finish, one_error_line, run_cli, start, train, wait_for_line
from support.runs import attempts, png_size

from trainer.inspect import listing, report as reports
from trainer.inspect.report import advise, format_report
from trainer.inspect.timeline import DASHBOARD, REPORT, WallAxis, lane_label, render_timeline, timeline_title
from trainer.run.interval import daly_interval, expected_goodput
from trainer.run.records import AttemptRecord


def build_report(records: list[dict], *args, **kwargs):
    """The report of hand-built records, each parsed as `read_attempt_records` parses a record."""
    return reports.build_report([AttemptRecord.parse(r) for r in records], *args, **kwargs)


def attempt_rows(records: list[dict]) -> list[dict]:
    return listing.attempt_rows([AttemptRecord.parse(r) for r in records])


def record(id, status, first, last, restored=None, replayed=None, published=(), wall=10.0, exit_code=None,
           costs=None, started="2026-01-01T00:00:00+00:00"):
    return {"id": id, "status": status, "exit_code": exit_code, "reason": None, "started_utc": started,
            "wall_s": wall,
            "restored": None if restored is None else {"name": f"step-{restored:08d}", "step": restored},
            "first_step": first, "last_step": last, "steps_replayed": replayed,
            "generations_published": [{"name": f"step-{s:08d}", "step": s, "save_s": 0.5, "blocked_s": 0.5,
                                       "at_s": at} for s, at in published],
            "exports_published": [], "costs": costs or {"restore_s": 0.0, "save_s": 0.0, "blocked_s": 0.0, "saves": 0}}


def history() -> list[dict]:
    """interrupted at 27 (published 8, 16, 24), killed at 34 (marker; published 32), refused,
    preempted at 37 (published 37), completed at 64."""
    return [
        record("a1", "interrupted", 0, 27, published=[(8, 2.0), (16, 4.0), (24, 6.0)], wall=7.0, exit_code=75,
               costs={"restore_s": 0.0, "save_s": 1.5, "blocked_s": 1.5, "saves": 3},
               started="2026-01-01T00:00:00+00:00"),
        record("a2", "running", 24, 32, restored=24, replayed=3, published=[(32, 3.0)], wall=None,
               costs={"restore_s": 1.0, "verify_s": 0.4, "save_s": 0.5, "blocked_s": 0.5, "saves": 1},
               started="2026-01-01T00:00:10+00:00"),
        record("a3", "refused", None, None, wall=0.5, exit_code=65, started="2026-01-01T00:00:20+00:00"),
        record("a4", "preempted", 32, 37, restored=32, replayed=2, published=[(37, 2.0)], wall=3.0, exit_code=75,
               costs={"restore_s": 1.0, "verify_s": 0.4, "save_s": 0.5, "blocked_s": 0.5, "saves": 1},
               started="2026-01-01T00:00:30+00:00"),
        record("a5", "completed", 37, 64, restored=37, replayed=0, published=[(40, 2.0), (48, 4.0), (64, 8.0)],
               wall=9.0, exit_code=0,
               costs={"restore_s": 1.0, "verify_s": 0.4, "save_s": 1.5, "blocked_s": 1.5, "saves": 3},
               started="2026-01-01T00:00:40+00:00"),
    ]


def test_rows_and_totals_of_a_known_history():
    records = history()
    records[1]["last_step"] = 34  # read_attempt_records takes a killed attempt's last step from its marker
    marker = 1767225600.0 + 10 + 5.0  # its last step was marked 5 s after it started
    report = build_report(records, markers={"a2": marker})
    rows = {row.id: row for row in report.rows}
    assert [r.outcome for r in report.rows] == ["interrupted", "killed", "refused", "preempted", "completed"]
    assert (rows["a1"].computed, rows["a1"].replayed, rows["a1"].lost, rows["a1"].durable_step) == (27, 0, 3, 24)
    assert (rows["a2"].computed, rows["a2"].replayed, rows["a2"].lost) == (10, 3, 2)
    assert rows["a2"].wall_s == 5.0 and rows["a2"].wall_estimated  # from the marker's time
    assert (rows["a3"].computed, rows["a3"].lost, rows["a3"].replayed) == (0, 0, 0)
    assert (rows["a4"].computed, rows["a4"].replayed, rows["a4"].lost) == (5, 2, 0)
    assert (rows["a5"].computed, rows["a5"].lost, rows["a5"].time_to_durable_s) == (27, 0, 2.0)
    assert [r.start_s for r in report.rows] == [0, 10, 20, 30, 40]

    t = report.totals
    assert (t.attempts, t.useful, t.computed, t.replayed, t.lost) == (5, 64, 69, 5, 5)
    assert t.computed == t.useful + t.lost  # every attempt restored its predecessor's newest generation
    assert t.goodput == pytest.approx(64 / 69)
    assert t.wall_s == pytest.approx(7 + 5 + 0.5 + 3 + 9)
    assert t.span_s == pytest.approx(40 + 9)
    # lost steps x seconds per step (wall - restore - blocked) / computed, + restores, + refused wall
    per_step_a1 = (7.0 - 0 - 1.5) / 27
    per_step_a2 = (5.0 - 1.0 - 0.5) / 10
    assert t.wall_lost_s == pytest.approx(3 * per_step_a1 + 2 * per_step_a2 + 3 * 1.0 + 0.5, abs=1e-3)
    assert t.checkpoint_s == pytest.approx(1.5 + 0.5 + 0.5 + 1.5)
    assert t.checkpoint_share == pytest.approx(4.0 / 24.5)
    assert t.outcomes == {"completed": 1, "interrupted": 1, "preempted": 1, "killed": 1, "refused": 1}
    table = format_report(report, "RUN")
    assert "goodput            92.8%" in table and "killed" in table and "5.0~" in table
    # Each total says what it counts: lost inside the attempts, without the start-up R counts per restart.
    assert f"lost in attempts   {t.wall_lost_s:.1f} s: lost steps' training, restores {t.restore_s:.1f} s, refused attempts " \
           "(no start-up: R below counts it, per restart)" in table and "lost to restarts" not in table


def test_going_back_counts_abandoned_steps_and_list_agrees_with_report():
    """Extended to 80, then sent back with --from-generation step-00000064 (and --epochs 8):
    the 16 steps above 64 were durable, are abandoned, and nothing was replayed after all."""
    records = [
        record("a1", "interrupted", 0, 27, published=[(24, 6.0)], exit_code=75),
        record("a2", "completed", 24, 64, restored=24, replayed=3, published=[(64, 6.0)], exit_code=0),
        record("a3", "completed", 64, 80, restored=64, replayed=0, published=[(72, 2.0), (80, 4.0)], exit_code=0),
        record("a4", "completed", 64, 64, restored=64, replayed=16, published=[], exit_code=0),
    ]
    report = build_report(records)
    rows = {row.id: row for row in report.rows}
    assert [(r.computed, r.replayed, r.lost, r.abandoned) for r in report.rows] == [
        (27, 0, 3, 0), (40, 3, 0, 0), (16, 0, 0, 16), (0, 0, 0, 0)]
    t = report.totals
    assert (t.useful, t.computed, t.lost, t.abandoned) == (64, 83, 3, 16)
    assert t.computed == t.useful + t.lost + t.abandoned
    assert rows["a4"].replayed == 0
    listed = attempt_rows(records)
    assert [a["steps_replayed"] for a in listed] == [None, 3, 0, 0]  # the first attempt replayed nothing
    assert [r.replayed for r in report.rows] == [0, 3, 0, 0]
    assert [a["abandoned"] for a in listed] == [0, 0, 16, 0]
    assert "abandoned 16" in format_report(report, "RUN")


def test_a_restore_from_tier0_keeps_the_steps_up_to_it():
    """Killed at 30 after a durable save at 24 and a tier-0 save at 28; the next attempt restored
    tier-0 step 28: steps 25-28 are kept, only 29-30 lost. A tier-0 step above the killed
    attempt's last (another line's) or a disk restore changes nothing."""
    records = [record("a1", "running", 0, 30, published=[(24, 6.0)]),
               record("a2", "completed", 28, 64, restored=28, replayed=2, published=[(64, 6.0)], exit_code=0)]
    records[1]["restored"]["tier"] = "memory"
    report = build_report(records)
    assert [(r.durable_step, r.lost, r.replayed) for r in report.rows] == [(28, 2, 0), (64, 0, 2)]
    t = report.totals
    assert (t.useful, t.computed, t.lost, t.replayed) == (64, 66, 2, 2) and t.computed == t.useful + t.lost
    assert t.goodput == pytest.approx(64 / 66)
    records[1]["restored"]["tier"] = "disk"  # the same step from disk: not this path, as before
    assert [r.lost for r in build_report(records).rows] == [6, 0]
    records[1]["restored"] = {"name": "step-00000031", "step": 31, "tier": "memory"}
    assert [r.lost for r in build_report(records).rows] == [6, 0]


def test_advice_from_a_known_history_uses_daly_and_says_what_it_rests_on():
    records = history()
    for r in records:
        r["startup_s"] = 2.0
    report = build_report(records)
    advice = advise(report)
    # C: mean blocked per recovery save; R: start-up (less verify) + restore of the 3 restarts
    assert advice.saves == 8 and advice.cost_s == pytest.approx(0.5)
    assert advice.restarts == 3 and advice.restart_s == pytest.approx((2.0 - 0.4) + 0.4 + 0.6)
    # M: 3 failures (interrupted, killed, preempted) over the trained attempts' wall + start-up
    exposure = (7 + 2) + (3 + 2) + (3 + 2) + (9 + 2)  # the killed one: up to its last publish, no marker
    assert (advice.failures, advice.exposure_s, advice.trusted) == (3, exposure, True)
    assert advice.mtbf_s == pytest.approx(exposure / 3)
    assert advice.interval_s == pytest.approx(daly_interval(0.5, exposure / 3))
    assert advice.predicted_goodput == pytest.approx(expected_goodput(advice.interval_s, 0.5, 2.6, exposure / 3))
    assert advice.current_goodput <= advice.predicted_goodput
    table = format_report(report, "RUN", advice)
    assert "Daly's higher-order form" in table and "too few failures" not in table
    assert "(3 restarts)" in table and "s from a save's start until it was durable" in table
    assert f"restart cost R      {advice.restart_s:.3g} s per restart = start-up " in table
    assert "1st durable s" in table and " to durable s" not in table  # one phrase, one meaning
    assert "of the time spent (kept steps' training time over all attempts' time, process start-up included: " \
           "low when steps are as short as the demo's)" in table

    few = advise(build_report(records[-1:]))
    assert not few.trusted and "too few failures (0)" in format_report(report, "RUN", few)
    assert "(1 restart)" in format_report(build_report(records[:2]), "RUN", advise(build_report(records[:2])))
    assumed = advise(build_report(records[-1:]), assume_mtbf_s=3600.0)
    assert assumed.trusted and assumed.mtbf_s == 3600.0 and assumed.interval_s == pytest.approx(
        daly_interval(0.5, 3600.0))


def test_wall_axis_compresses_long_idle_gaps_and_keeps_attempts_to_scale():
    axis = WallAxis.of([(0, 10), (5, 12), (100, 110), (111, 120)])
    (left, right, idle), = axis.gaps  # the 88 s wait; the 1 s one stays
    assert idle == 88 and right - left == pytest.approx(0.03 * 31)
    assert axis.x(12) == 12 and axis.x(110) - axis.x(100) == pytest.approx(10)
    assert axis.x(120) - axis.x(111) == pytest.approx(9) and axis.x(100) == pytest.approx(right)


def test_a_live_running_attempt_is_running_and_loses_nothing_yet():
    records = [record("a1", "running", 0, 12, published=[(8, 1.0)], wall=None)]
    assert build_report(records).rows[0].outcome == "killed"
    live = build_report(records, live=frozenset({"a1"}))
    assert live.rows[0].outcome == "running" and live.rows[0].lost == 0
    assert live.rows[0].wall_s == 1.0 and live.rows[0].wall_estimated  # no marker: its last publish
    assert live.totals.useful == 8 and live.totals.goodput == pytest.approx(8 / 12)
    assert "~ running: wall time up to" in format_report(live, "RUN")  # the legend names what it marks
    assert lane_label(1, live.rows[0]) == "#1 running" and lane_label(2, build_report(history()).rows[0]) == \
        "#2 interrupted (75)"


def test_odd_records_do_not_break_the_report():
    records = [{"id": "x", "status": "running", "exit_code": None, "restored": None, "last_step": None,
                "steps_replayed": None, "wall_s": None, "reason": None, "generations_published": [],
                "exports_published": [], "started_utc": "garbage"}]
    report = build_report(records)
    assert report.rows[0].outcome == "killed" and report.rows[0].computed == 0 and report.totals.goodput is None
    assert report.rows[0].start_s is None and report.rows[0].wall_s is None
    format_report(report, "RUN")
    assert build_report([]).totals.attempts == 0


@pytest.mark.parametrize("count", [1, 100])
def test_timeline_png_has_the_stated_size_for_1_and_100_attempts(tmp_path, count):
    """Both layouts; the dashboard's is wide enough to be drawn whole in Polyaxon's 350 px
    image widget at a 1440 px window (1209 px wide: under 328 px of picture below its caption)."""
    outcomes = ["interrupted", "preempted", "running", "refused", "failed"]
    records, step = [], 0
    for i in range(count):
        status = "completed" if i == count - 1 else outcomes[i % len(outcomes)]
        last = step if status == "refused" else step + 7
        records.append(record(f"a{i:03d}", status, None if status == "refused" else step,
                              None if status == "refused" else last, restored=step or None, replayed=2 if i else 0,
                              published=[(step + 4, 1.0)] if status != "refused" else [],
                              wall=None if status == "running" else 3.0,
                              started=f"2026-01-01T{i // 60:02d}:{i % 60:02d}:00+00:00"))
        step = step + 4 if status != "refused" else step
    report = build_report(records)
    path = tmp_path / "timeline.png"
    title = timeline_title(report)
    assert " useful steps of " in title and "% of steps, " in title and " of time), " in title, title
    render_timeline(report, path, title)
    assert path.stat().st_size > 10_000
    assert png_size(path) == (REPORT.width, REPORT.height) == (1600, 900)
    render_timeline(report, path, title, DASHBOARD)
    assert png_size(path) == (DASHBOARD.width, DASHBOARD.height)
    assert 1209 * DASHBOARD.height / DASHBOARD.width < 328


# ---------------------------------------------------------------- the command, on a real run
EPOCHS = ("--epochs", 8)


@pytest.fixture(scope="module")
def storm(tmp_path_factory):
    """A run with a known history: interrupt at 27, kill -9 after step 34 was logged (it
    published step 32 first), a refused start, a SIGTERM after step 36 was logged, then
    completion at 64. Steps take milliseconds, so the kill and the signal land a few steps
    after the line: the test reads where from the records."""
    run = tmp_path_factory.mktemp("storm") / "run"
    train(run, *EPOCHS, "--interrupt-at-step", 27, expect=75)
    process = start(run, *EPOCHS, "--resume")
    wait_for_line(process, "step=34 ")
    process.kill()
    process.wait()
    refused = run_cli("--output", run, *EPOCHS, "--resume", "--hidden-size", 7, "--allow-drift", "config")
    assert refused.returncode == 65
    process = start(run, *EPOCHS, "--resume")
    wait_for_line(process, "step=36 ")
    process.send_signal(signal.SIGTERM)
    finish(process)
    assert process.returncode == 75
    train(run, *EPOCHS, "--resume")
    return run


def test_report_numbers_equal_those_derived_from_the_known_history(storm, tmp_path):
    records = attempts(storm)
    assert [r["status"] for r in records] == ["interrupted", "running", "refused", "preempted", "completed"]
    killed_at = int((storm / "attempts" / records[1]["id"] / "last_step").read_text())  # the per-step marker
    killed_durable = max(g["step"] for g in records[1]["generations_published"])  # 32, or later if it ran on
    preempted_at = records[3]["last_step"]
    assert killed_at >= 34 and killed_durable >= 32 and preempted_at >= 36

    png = tmp_path / "storm.png"
    fresh = {"MPLCONFIGDIR": str(tmp_path / "mpl")}  # matplotlib builds its font cache: it must say nothing
    result = run_cli("report", storm, "--json", "--png", png, env=fresh)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == f"timeline written to {png}"
    report = json.loads(result.stdout)
    rows = report["rows"]
    assert [r["outcome"] for r in rows] == ["interrupted", "killed", "refused", "preempted", "completed"]
    expected = [  # restored, computed, replayed, lost
        (None, 27, 0, 27 - 24),
        ("step-00000024", killed_at - 24, 27 - 24, killed_at - killed_durable),
        (None, 0, 0, 0),
        # the stop's save, then one step for the witness (issue 57): computed, lost, replayed by the next
        (f"step-{killed_durable:08d}", preempted_at + 1 - killed_durable,
         min(killed_at, preempted_at + 1) - killed_durable, 1),
        (f"step-{preempted_at:08d}", 64 - preempted_at, 1, 0),
    ]
    assert [(r["restored"], r["computed"], r["replayed"], r["lost"]) for r in rows] == expected
    assert [r["exit_code"] for r in rows] == [75, None, 65, 75, 0]
    assert rows[1]["wall_estimated"] and rows[1]["wall_s"] > 0
    computed = sum(e[1] for e in expected)
    totals = report["totals"]
    assert (totals["useful"], totals["computed"], totals["lost"]) == (64, computed, 3 + killed_at - killed_durable + 1)
    assert totals["goodput"] == pytest.approx(64 / computed)
    restores = sum(r["costs"]["restore_s"] for r in records)
    assert totals["restore_s"] == pytest.approx(restores, abs=1e-3)
    assert totals["wall_lost_s"] >= totals["restore_s"] + records[2]["wall_s"] - 1e-3
    assert totals["checkpoint_s"] == pytest.approx(sum(r["costs"]["blocked_s"] for r in records), abs=1e-3)
    # every publish has its time; the first durable point of an attempt is its first publish
    assert rows[0]["time_to_durable_s"] == records[0]["generations_published"][0]["at_s"] > 0
    assert png_size(png) == (1600, 900)
    advice = report["advice"]  # interrupted, killed and preempted: three failures, enough to plan with
    assert (advice["failures"], advice["trusted"], advice["restarts"]) == (3, True, 3)
    assert advice["cost_s"] > 0 and advice["restart_s"] > advice["startup_s"] > 0
    assert 0 < advice["predicted_goodput"] < 1 and advice["interval_s"] > 0
    last = records[-1]  # coarse step times: every 8th global step it computed
    assert [s for s, _ in last["progress"]["points"]] == [s for s in range(last["first_step"] + 1, 65) if s % 8 == 0]

    table = run_cli("report", storm)
    assert table.returncode == 0
    lines = [line.split() for line in table.stdout.splitlines() if line.startswith(("    1", "    2", "    5"))]
    assert [line[2] for line in lines] == ["interrupted", "killed", "completed"]
    assert f"goodput            {64 / computed:.1%}" in table.stdout
    assert "save interval advice" in table.stdout and "best interval" in table.stdout


def test_report_errors_are_one_line(storm, tmp_path):
    missing = run_cli("report", tmp_path / "nope")
    assert missing.returncode == 66 and one_error_line(missing).endswith(
        f"{tmp_path / 'nope'} does not exist; pass the --output of a run")
    manifest = tmp_path / "step-00000008" / "manifest.json"  # what a new user tries first
    manifest.parent.mkdir()
    manifest.write_text("{}")
    for command, wanted in (("verify", 66), ("list", 66)):
        pointed = run_cli(command, manifest)
        assert pointed.returncode == wanted and one_error_line(pointed).endswith(
            f"{manifest} is a generation's manifest file; pass its folder, {manifest.parent}"), pointed.stderr
    (tmp_path / "a-file").write_text("")
    a_file = run_cli("verify", tmp_path / "a-file")
    assert one_error_line(a_file).endswith("a-file is a file, not a folder; pass a run directory or a generation")
    (tmp_path / "empty").mkdir()
    empty = run_cli("report", tmp_path / "empty")
    assert empty.returncode == 66 and "no attempt records" in one_error_line(empty)
    unwritable = run_cli("report", storm, "--png", tmp_path / "no" / "such" / "dir.png")
    assert unwritable.returncode == 74 and "choose a writable path for --png" in one_error_line(unwritable)
    usage = run_cli("report")
    assert usage.returncode == 2 and "python -m trainer report" in one_error_line(usage)


def test_a_trainer_that_is_still_running_is_shown_running_then_killed(tmp_path):
    run = tmp_path / "run"
    process = start(run, "--epochs", 400)
    try:
        wait_for_line(process, "step=3 ")
        live = json.loads(run_cli("report", run, "--json").stdout)["rows"]
        assert [row["outcome"] for row in live] == ["running"] and live[0]["lost"] == 0
    finally:
        process.kill()
        process.wait()
    dead = json.loads(run_cli("report", run, "--json").stdout)["rows"]
    assert [row["outcome"] for row in dead] == ["killed"] and dead[0]["wall_estimated"]


def test_a_record_is_parsed_once_tolerating_what_older_records_lack():
    """`AttemptRecord.parse`: a record from before `store` and `started_unix` were kept reads its
    store from the `--output` of its argv and its start from `started_utc`; a field of the wrong
    type reads as absent."""
    older = {"id": "a1", "status": "completed", "argv": ["python", "-m", "trainer", "--output=s3://b/run"],
             "started_utc": "2026-01-01T00:00:00+00:00", "costs": {"save_s": "?", "saves": 2},
             "generations_published": [{"name": "step-00000008", "step": "8", "at_s": 1.5}, {"step": 16}]}
    parsed = AttemptRecord.parse(older)
    assert (parsed.store, parsed.started_unix, parsed.restored) == ("s3://b/run", 1767225600.0, None)
    assert [(e.name, e.step, e.at_s) for e in parsed.generations] == [("step-00000008", None, 1.5)]
    assert (parsed.costs.save_s, parsed.costs.saves, parsed.exports) == (0.0, 2, ())
    assert AttemptRecord.parse({**older, "store": None}).store is None  # a newer record's word wins
