"""The recovery timeline as a PNG: one lane per attempt, over wall-clock time (left) and
global step (right), coloured by outcome.

matplotlib is imported here only, when a picture is asked for (`report --png`, the tracked
end-of-attempt hook): training never pays for it. The figure is drawn on its own Agg canvas,
so no global backend or pyplot state is touched. The size is fixed by the layout (REPORT for
`report --png`, DASHBOARD for Polyaxon's image widget) whatever the number of attempts: the
lanes share the whole height, tick labels get sparser.

Within an attempt, steps are placed in time by its coarse progress points (a step and its
time, every few steps, in the record); between points, and in records without any, they
are spread evenly. Idle gaps between attempts (scheduling, a retry's back-off) longer than
GAP_SHARE of the busy time are drawn GAP_WIDTH wide and marked with their real length, so
long waits do not squeeze every attempt into a sliver.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from trainer.inspect.report import AttemptRow, Report

DPI = 100


@dataclass(frozen=True)
class Layout:
    """A picture's size in pixels and where its legend goes."""

    width: int
    height: int
    legend_right: bool


REPORT = Layout(1600, 900, legend_right=False)
DASHBOARD = Layout(2200, 560, legend_right=True)
"""Polyaxon 2.18's image widget is 350 px tall and as wide as the page (1209 px in a 1440 px
window), and crops what is taller: a picture wider than about 3.7:1 is drawn whole in it."""
COLOURS = {"completed": "#2e7d32", "interrupted": "#1565c0", "preempted": "#ef6c00", "killed": "#c62828",
           "failed": "#6a1b9a", "refused": "#757575", "running": "#00838f"}
RESTORE_COLOUR = "#424242"
STARTUP_COLOUR = "#bdbdbd"
LOST_COLOUR = "#212121"
ABANDONED_COLOUR = "#fbc02d"
GAP_SHARE, GAP_WIDTH = 0.1, 0.03
"""An idle gap longer than GAP_SHARE of the busy seconds is drawn GAP_WIDTH of them wide."""


def lane_ticks(lanes: int) -> list[int]:
    """Which lanes get a label: all of a few, then every k-th, so 100 stay readable."""
    every = max(1, math.ceil(lanes / 20))
    return list(range(0, lanes, every))


def lane_label(number: int, row: AttemptRow) -> str:
    return f"#{number} {row.outcome}" + ("" if row.exit_code is None else f" ({row.exit_code})")


@dataclass(frozen=True)
class WallAxis:
    """Real seconds to drawn position, with long idle gaps compressed."""

    knots: tuple[tuple[float, float], ...]
    """(real seconds, drawn position), increasing in both."""
    gaps: tuple[tuple[float, float, float], ...]
    """(drawn start, drawn end, real seconds) of each compressed gap."""

    @classmethod
    def of(cls, spans: list[tuple[float, float]]) -> "WallAxis":
        merged: list[list[float]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        busy = sum(end - start for start, end in merged) or 1.0
        first = merged[0][0] if merged else 0.0
        knots, gaps, shift = [(first, first)], [], 0.0
        for (_, end), (start, _) in zip(merged, merged[1:]):
            idle = start - end
            if idle > GAP_SHARE * busy:
                drawn = GAP_WIDTH * busy
                knots += [(end, end - shift), (start, end - shift + drawn)]
                gaps.append((end - shift, end - shift + drawn, idle))
                shift += idle - drawn
        return cls(tuple(knots), tuple(gaps))

    def x(self, seconds: float) -> float:
        """Piecewise linear: slope 1 outside the gaps, compressed inside them."""
        knots = self.knots
        index = bisect.bisect_right([real for real, _ in knots], seconds) - 1
        if index < 0 or index == len(knots) - 1:
            real, drawn = knots[0] if index < 0 else knots[-1]
            return drawn + seconds - real
        (r0, d0), (r1, d1) = knots[index], knots[index + 1]
        return d0 + (seconds - r0) * (d1 - d0) / (r1 - r0)


def step_times(row: AttemptRow, train_from: float, end: float) -> list[tuple[int, float]]:
    """(step, seconds since the first start) knots of the attempt: its first step when its
    training began, each recorded progress point, its last step at its end."""
    start = row.start_s or 0.0
    inner = [(step, start + at) for step, at in row.progress
             if row.first_step < step < row.last_step and train_from <= start + at <= end]
    return [(row.first_step, train_from), *inner, (row.last_step, end)]


def time_of_step(knots: list[tuple[int, float]], step: float) -> float:
    for (s0, t0), (s1, t1) in zip(knots, knots[1:]):
        if step <= s1:
            return t0 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return knots[-1][1]


def render_timeline(report: Report, path: Path, title: str, layout: Layout = REPORT) -> None:
    """Write the timeline to `path` (PNG, the layout's size). OSError if it cannot be written."""
    # Before the import: building the font cache logs "generated new fontManager" at INFO.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    figure = Figure(figsize=(layout.width / DPI, layout.height / DPI), dpi=DPI)
    FigureCanvasAgg(figure)
    wall_ax, step_ax = figure.subplots(1, 2, sharey=True, gridspec_kw={"wspace": 0.1})
    lanes = max(len(report.rows), 1)
    height = 0.72 if lanes > 2 else 0.45
    mark = max(2.0, min(9.0, 260 / lanes))  # marker size in points, thinner lanes get smaller marks
    edge = 0.0 if lanes > 40 else 0.4
    spans = [(row.start_s - (row.startup_s or 0.0), row.start_s + row.wall_s) for row in report.rows
             if row.start_s is not None and row.wall_s is not None]
    axis = WallAxis.of(spans)
    x = axis.x

    def wall_bar(lane, left, right, **style):
        wall_ax.barh(lane, x(right) - x(left), left=x(left), height=height, **style)

    for lane, row in enumerate(report.rows):
        colour = COLOURS.get(row.outcome, COLOURS["failed"])
        lost_from = row.last_step - row.lost
        abandoned_from = row.durable_step - row.abandoned
        # ---- global step
        if row.computed:
            step_ax.barh(lane, row.computed, left=row.first_step, height=height, color=colour, linewidth=edge,
                         edgecolor="black")
            if row.replayed:
                step_ax.barh(lane, row.replayed, left=row.first_step, height=height, color="white", alpha=0.55,
                             hatch="////", linewidth=0)
            if row.abandoned:
                step_ax.barh(lane, row.abandoned, left=abandoned_from, height=height, color=ABANDONED_COLOUR,
                             hatch="xx", linewidth=0)
            if row.lost:
                step_ax.barh(lane, row.lost, left=lost_from, height=height, color=LOST_COLOUR, linewidth=0)
        saves = [g.step for g in row.generations if isinstance(g.step, int)]
        step_ax.plot(saves, [lane] * len(saves), "|", color="black", markersize=mark * 1.6, markeredgewidth=1.2)
        if row.restored is not None:
            step_ax.plot([row.first_step], [lane], ">", color=RESTORE_COLOUR, markersize=mark)
        step_ax.plot([row.last_step], [lane], "D" if row.outcome != "refused" else "x", color=colour,
                     markersize=mark * 0.8, markeredgecolor="black", markeredgewidth=0.5)
        # ---- wall-clock time
        if row.start_s is None or row.wall_s is None:
            continue
        start, end = row.start_s, row.start_s + row.wall_s
        train_from = min(end, start + row.restore_s)
        if row.startup_s:
            wall_bar(lane, start - row.startup_s, start, color=STARTUP_COLOUR, linewidth=0)
        if row.restore_s:
            wall_bar(lane, start, train_from, color=RESTORE_COLOUR, linewidth=0)
        wall_bar(lane, train_from, end, color=colour, linewidth=edge, edgecolor="black",
                 linestyle="--" if row.wall_estimated else "-")
        if row.computed:
            knots = step_times(row, train_from, end)
            if row.replayed:
                wall_bar(lane, train_from, time_of_step(knots, row.first_step + row.replayed), color="white",
                         alpha=0.55, hatch="////", linewidth=0)
            if row.abandoned:
                wall_bar(lane, time_of_step(knots, abandoned_from), time_of_step(knots, row.durable_step),
                         color=ABANDONED_COLOUR, hatch="xx", linewidth=0)
            if row.lost:
                wall_bar(lane, time_of_step(knots, lost_from), end, color=LOST_COLOUR, linewidth=0)
        at = [x(start + g.at_s) for g in row.generations if isinstance(g.at_s, (int, float))]
        wall_ax.plot(at, [lane] * len(at), "|", color="black", markersize=mark * 1.6, markeredgewidth=1.2)
        if row.restored is not None:
            wall_ax.plot([x(start)], [lane], ">", color=RESTORE_COLOUR, markersize=mark)
        wall_ax.plot([x(end)], [lane], "D" if row.outcome != "refused" else "x", color=colour,
                     markersize=mark * 0.8, markeredgecolor="black", markeredgewidth=0.5)

    for left, right, idle in axis.gaps:  # a compressed idle gap: shaded, with its real length
        wall_ax.axvspan(left, right, color="#eeeeee", hatch="..", zorder=0)
        wall_ax.text((left + right) / 2, -0.45, f"idle {idle:.0f} s", ha="center", va="top", fontsize=8,
                     rotation=90)
    ticks = lane_ticks(lanes)
    wall_ax.set_yticks(ticks, [lane_label(lane + 1, report.rows[lane]) for lane in ticks if lane < len(report.rows)]
                       or ["#1"])
    wall_ax.set_ylim(lanes - 0.5, -0.5)  # attempt 1 at the top; the lanes share the whole height
    wall_ax.set_ylabel("attempt (outcome, exit code)")
    wall_ax.set_xlabel("wall-clock seconds since the first attempt's record started (start-up before it)"
                       + (" (idle gaps compressed)" if axis.gaps else ""))
    if axis.gaps:  # ticks in real seconds, since positions after a gap are shifted
        positions = [x(s) for s, _ in spans] + [x(e) for _, e in spans]
        labels = [f"{s:.0f}" for s, _ in spans] + [f"{e:.0f}" for _, e in spans]
        wall_ax.set_xticks(positions, labels, fontsize=8)
    step_ax.set_xlabel("global optimizer step")
    wall_ax.set_xlim(left=min([0.0] + [x(s) for s, _ in spans]))
    step_ax.set_xlim(left=0)
    for ax in (wall_ax, step_ax):
        ax.grid(axis="x", alpha=0.3)
    present = [name for name in COLOURS if any(row.outcome == name for row in report.rows)]
    handles = [Patch(color=COLOURS[name], label=name) for name in present] + [
        Patch(facecolor="white", edgecolor="grey", hatch="////", label="replayed (redone) steps"),
        Patch(color=LOST_COLOUR, label="lost steps (redone by the next attempt)"),
        Patch(facecolor=ABANDONED_COLOUR, hatch="xx", label="abandoned steps (a later attempt went back)"),
        Patch(color=STARTUP_COLOUR, label="process start-up"),
        Patch(color=RESTORE_COLOUR, label="restore + verify"),
        Line2D([], [], marker=">", linestyle="", color=RESTORE_COLOUR, label="restored"),
        Line2D([], [], marker="|", linestyle="", color="black", markersize=10, label="generation published"),
        Line2D([], [], marker="D", linestyle="", color="grey", markeredgecolor="black",
               label="end (dashed edge: estimated, killed or running)"),
    ]
    if layout.legend_right:
        figure.legend(handles=handles, loc="center right", ncol=1, frameon=False, fontsize=9)
        figure.subplots_adjust(left=0.08, right=0.8, top=0.88, bottom=0.14)
    else:
        figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), frameon=False, fontsize=9)
        figure.subplots_adjust(left=0.11, right=0.99, top=0.92, bottom=0.17)
    figure.suptitle(title, fontsize=12)
    figure.savefig(path, format="png", dpi=DPI)


def timeline_title(report: Report) -> str:
    t = report.totals
    goodput = "-" if t.goodput is None else f"{t.goodput:.1%}"
    by_time = "-" if t.time_goodput is None else f"{t.time_goodput:.1%}"
    share = "-" if t.checkpoint_share is None else f"{t.checkpoint_share:.1%}"
    return (f"{t.attempts} attempt{'' if t.attempts == 1 else 's'}: {t.useful} useful steps of {t.computed} "
            f"computed (goodput {goodput} of steps, {by_time} of time), "
            f"{t.wall_lost_s:.1f} s lost in attempts, checkpoint overhead {share} of wall time")
