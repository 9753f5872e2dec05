"""Which tier-0 generations every rank can restore, decided at the claim from what each rank
holds: every rank's part can be had (its own, or a peer's replica: `available_everywhere`), it
is newer than the newest durable generation and continues its line (`newer_than`), and every
rank was given the same tier-0 settings (`disagreement`). Pure: it reads no disk."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from trainer.checkpoint.identity import RunIdentity
from trainer.layout import generation_step

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Agreement:
    """What every rank's tier 0 must be given alike, checked at the claim (`disagreement`):
    the cadence and the count kept decide the tier-0 save points, and so the replica's rounds
    every rank runs in step; the processes per node decide who is whose partner. A difference
    would leave ranks waiting in those rounds until the background bound."""

    every_steps: int | str
    """N, or "auto"."""
    keep: int
    local_world_size: int


AGREED = (("--memory-every-steps", "every_steps", "give the same on every node"),
          ("--memory-keep", "keep", "give the same on every node"),
          ("processes per node (torchrun --nproc-per-node, LOCAL_WORLD_SIZE)", "local_world_size",
           "start the same number on every node, or drop --memory-dir"))


def disagreement(agreements: list[Agreement | None]) -> str | None:
    """The one line refusing tier-0 settings that differ between ranks (None: they agree).
    `agreements`: every rank's, in rank order (None: no --memory-dir there)."""
    without = [rank for rank, agreement in enumerate(agreements) if agreement is None]
    if len(without) == len(agreements):
        return None  # no tier 0 anywhere
    if without:
        return f"--memory-dir is given to some ranks but not to rank(s) {without}; give it on every node, or on none"
    for option, field_name, fix in AGREED:
        values: dict[object, list[int]] = {}
        for rank, agreement in enumerate(agreements):
            values.setdefault(getattr(agreement, field_name), []).append(rank)
        if len(values) > 1:
            found = ", ".join(f"{value} on {ranks_named(ranks)}" for value, ranks in values.items())
            return f"tier 0: {option} differs between nodes ({found}); {fix}"
    return None


def ranks_named(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0-3`, `ranks 0-1, 4-5`: consecutive ranks as ranges (sorted input)."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    named = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)
    return f"rank {named}" if len(ranks) == 1 else f"ranks {named}"



@dataclass(frozen=True)
class Holding:
    """What one rank's tier 0 holds, for rank 0 to choose from: per rank whose part it keeps
    (its own, and the replica of one other), the run that part is bound to and each
    generation's writing attempt ("" when its manifest does not read)."""

    rank: int
    parts: dict[int, tuple[str | None, dict[str, str]]] = field(default_factory=dict)


MISSING = "not in this node's tier 0"


def available_everywhere(holdings: list[Holding], run: str) -> dict[str, str]:
    """The tier-0 generations of run `run` whose part every rank can have: its own, or a
    replica on another rank; {name: its writing attempt}. Every part must have been written by
    the same attempt: a part of the same step from another line (an attempt that went back, a
    replica that stopped) is never combined with this one's."""
    offered: dict[int, set[tuple[str, str]]] = {}
    for holding in holdings:
        for rank, (bound, generations) in holding.parts.items():
            if bound == run:
                offered.setdefault(rank, set()).update(generations.items())
    if len(holdings) == 0 or any(rank not in offered for rank in range(len(holdings))):
        return {}
    common = set.intersection(*(offered[rank] for rank in range(len(holdings))))
    return dict(sorted(common))



def newer_than(holdings: list[Holding], durable: list[str], went_back: list[tuple[str, int]],
               run: RunIdentity | None) -> dict[str, str]:
    """Tier-0 generations newer than the newest durable one that continue its line: every
    rank's part can be had (`available_everywhere`), bound to this run (`run`, the run
    directory's identity; None: a new run directory), and none was written by an attempt that
    a later attempt went back from (`--from-generation` to an earlier step, perhaps without
    tier 0, so it could not set them aside; `went_back`: (that attempt, the step it went back to),
    trainer/run/records.py `went_back`). {name: the attempt that wrote every part}."""
    if run is None:
        return {}  # nobody's yet: `bind` clears what another run left once this attempt goes ahead
    newest = generation_step(durable[-1]) if durable else -1
    newer = {}
    for name, attempt in available_everywhere(holdings, run.run).items():
        step = generation_step(name)
        if step <= newest:
            continue
        if any(later > attempt and back < step for later, back in went_back):
            log.info("tier 0 holds %s of an abandoned line (a later attempt went back): not restored", name)
            continue
        newer[name] = attempt
    return newer


