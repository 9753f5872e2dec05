"""What to keep: a pure selection over the generations on disk, and a thin apply step.

Only verified generations count towards "the newest K", so a damaged one can never push a
good one out. The generation just restored and the newest verified one are never deleted,
and nothing but our own published `step-%08d` directories is ever considered.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer import seams
from trainer.checkpoint.section import LocalSection
from trainer.layout import generation_step


@dataclass(frozen=True)
class Candidate:
    name: str
    verified: bool


def select_deletions(candidates: list[Candidate], keep_last: int | None, keep_every: int | None,
                     protected: frozenset[str]) -> list[str]:
    """Names to delete, given candidates oldest first. `keep_last=None` keeps everything.

    Unverified generations are never deleted here (an operator may want to inspect them).
    """
    if keep_last is None:
        return []
    verified = [c.name for c in candidates if c.verified]
    keep = set(verified[-keep_last:]) if keep_last > 0 else set()
    if verified:
        keep.add(verified[-1])
    if keep_every:
        keep |= {name for name in verified if generation_step(name) % keep_every == 0}
    keep |= protected
    return [name for name in verified if name not in keep]


def apply_retention(section: LocalSection, keep_last: int | None, keep_every: int | None,
                    protected: frozenset[str], later: bool = False) -> list[str]:
    """Delete what `select_deletions` picks; call only after a new publish, under the lock.
    `later`: their files are deleted in the background (`LocalSection.remove`)."""
    candidates = [Candidate(name, section.verify(name, cached=True).ok) for name in section.names()]
    doomed = select_deletions(candidates, keep_last, keep_every, protected)
    for name in doomed:
        seams.crash_point("before-retention")
        if later:
            section.remove(name, later=True)
        else:
            section.remove(name)
    return doomed

