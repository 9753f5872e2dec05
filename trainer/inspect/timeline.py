"""The recovery timeline as a PNG: one lane per attempt, over wall-clock time (left) and
global step (right), coloured by outcome.

matplotlib is imported here only, when a picture is asked for (`report --png`, the tracked
end-of-attempt hook): training never pays for it. The figure is drawn on its own Agg canvas,
so no global backend or pyplot state is touched. The size is fixed (WIDTH x HEIGHT pixels)
whatever the number of attempts: lanes get thinner, tick labels sparser.

Within an attempt, steps are drawn as if evenly spread over its training time (from the end
of its restore to its end): records keep when each publish happened (`at_s`), not when each
step did.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from trainer.inspect.report import Report

WIDTH, HEIGHT, DPI = 1600, 900, 100
COLOURS = {"completed": "#2e7d32", "interrupted": "#1565c0", "preempted": "#ef6c00", "killed": "#c62828",
           "failed": "#6a1b9a", "refused": "#757575", "running": "#00838f"}
RESTORE_COLOUR = "#424242"


def lane_ticks(lanes: int) -> list[int]:
    """Which lanes get a label: all of a few, then every k-th, so 100 stay readable."""
    every = max(1, math.ceil(lanes / 20))
    return list(range(0, lanes, every))


def render_timeline(report: Report, path: Path, title: str) -> None:
    """Write the timeline to `path` (PNG, WIDTH x HEIGHT). OSError if it cannot be written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its INFO lines (font cache) are not ours
    figure = Figure(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    FigureCanvasAgg(figure)
    wall_ax, step_ax = figure.subplots(1, 2, sharey=True, gridspec_kw={"wspace": 0.04})
    lanes = max(len(report.rows), 1)
    height = 0.72
    mark = max(2.0, min(9.0, 260 / lanes))  # marker size in points, thinner lanes get smaller marks
    edge = 0.0 if lanes > 40 else 0.4

    for lane, row in enumerate(report.rows):
        colour = COLOURS.get(row.outcome, COLOURS["failed"])
        # ---- global step
        if row.computed:
            step_ax.barh(lane, row.computed, left=row.first_step, height=height, color=colour, linewidth=edge,
                         edgecolor="black")
            if row.replayed:
                step_ax.barh(lane, row.replayed, left=row.first_step, height=height, color="white", alpha=0.55,
                             hatch="////", linewidth=0)
            if row.lost:
                step_ax.barh(lane, row.lost, left=row.last_step - row.lost, height=height, color="black",
                             alpha=0.35, linewidth=0)
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
        if row.restore_s:
            wall_ax.barh(lane, train_from - start, left=start, height=height, color=RESTORE_COLOUR, linewidth=0)
        wall_ax.barh(lane, end - train_from, left=train_from, height=height, color=colour, linewidth=edge,
                     edgecolor="black", linestyle="--" if row.wall_estimated else "-")
        if row.computed:
            per_step = (end - train_from) / row.computed
            if row.replayed:
                wall_ax.barh(lane, row.replayed * per_step, left=train_from, height=height, color="white",
                             alpha=0.55, hatch="////", linewidth=0)
            if row.lost:
                wall_ax.barh(lane, row.lost * per_step, left=end - row.lost * per_step, height=height,
                             color="black", alpha=0.35, linewidth=0)
        at = [start + g.at_s for g in row.generations if isinstance(g.at_s, (int, float))]
        wall_ax.plot(at, [lane] * len(at), "|", color="black", markersize=mark * 1.6, markeredgewidth=1.2)
        if row.restored is not None:
            wall_ax.plot([start], [lane], ">", color=RESTORE_COLOUR, markersize=mark)
        wall_ax.plot([end], [lane], "D" if row.outcome != "refused" else "x", color=colour,
                     markersize=mark * 0.8, markeredgecolor="black", markeredgewidth=0.5)

    ticks = lane_ticks(lanes)
    wall_ax.set_yticks(ticks, [f"#{lane + 1}" for lane in ticks])
    wall_ax.set_ylim(max(lanes, 6) - 0.5, -0.5)  # attempt 1 at the top; a few lanes stay thin
    wall_ax.set_ylabel("attempt")
    wall_ax.set_xlabel("wall-clock seconds since the first attempt started")
    step_ax.set_xlabel("global optimizer step")
    wall_ax.set_xlim(left=0)
    step_ax.set_xlim(left=0)
    for ax in (wall_ax, step_ax):
        ax.grid(axis="x", alpha=0.3)
    present = [name for name in COLOURS if any(row.outcome == name for row in report.rows)]
    handles = [Patch(color=COLOURS[name], label=name) for name in present] + [
        Patch(facecolor="white", edgecolor="grey", hatch="////", label="replayed (redone) steps"),
        Patch(facecolor="black", alpha=0.35, label="lost steps (redone by the next attempt)"),
        Patch(color=RESTORE_COLOUR, label="restore + verify"),
        Line2D([], [], marker=">", linestyle="", color=RESTORE_COLOUR, label="restored"),
        Line2D([], [], marker="|", linestyle="", color="black", markersize=10, label="generation published"),
        Line2D([], [], marker="D", linestyle="", color="grey", markeredgecolor="black", label="end"),
    ]
    figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 7), frameon=False, fontsize=9)
    figure.suptitle(title, fontsize=12)
    figure.subplots_adjust(left=0.05, right=0.99, top=0.92, bottom=0.16)
    figure.savefig(path, format="png", dpi=DPI)


def timeline_title(report: Report) -> str:
    t = report.totals
    goodput = "-" if t.goodput is None else f"{t.goodput:.1%}"
    share = "-" if t.checkpoint_share is None else f"{t.checkpoint_share:.1%}"
    return (f"{t.attempts} attempt{'' if t.attempts == 1 else 's'}: {t.useful} useful steps of {t.computed} "
            f"computed (goodput {goodput}), "
            f"{t.wall_lost_s:.1f} s lost to restarts, checkpoint overhead {share} of wall time")
