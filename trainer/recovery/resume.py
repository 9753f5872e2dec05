"""Resume policy (DESIGN.md §3): which generation, if any, a new process starts from.

Pure decisions over names and verification results; the caller does the I/O.
"""

from __future__ import annotations

import re
from typing import Callable

from trainer.errors import CorruptGeneration, NothingToResume, RefuseOverwrite
from trainer.recovery.manifest import Verification

GENERATION_NAME = re.compile(r"^step-(\d{8})$")


def generation_name(step: int) -> str:
    return f"step-{step:08d}"


def generation_step(name: str) -> int | None:
    match = GENERATION_NAME.match(name)
    return int(match.group(1)) if match else None


def choose_candidate(names: list[str], resume: str | None, from_generation: str | None,
                     where: str) -> str | None:
    """The generation to restore (not yet verified), or None for a fresh start.

    `names` are the published generations, sorted oldest first.
    """
    if from_generation is not None:
        if from_generation not in names:
            known = ", ".join(names[-3:]) or "none"
            raise NothingToResume(f"generation {from_generation} does not exist in {where} "
                                  f"(newest: {known}); pick one from `python -m trainer list`")
        return from_generation
    if resume is None:
        if names:
            raise RefuseOverwrite(f"{where} already holds generations (newest {names[-1]}); "
                                  f"continue with --resume, or choose an empty --output")
        return None
    if not names:
        if resume == "auto":
            return None
        raise NothingToResume(f"nothing to resume: no generation in {where}; "
                              f"start without --resume, or use --resume auto")
    return names[-1]


def require_verified(candidate: Verification, earlier: list[str],
                     verify: Callable[[str], Verification]) -> None:
    """Refuse a damaged candidate, naming the newest earlier generation that verifies."""
    if candidate.ok:
        return
    fallback = next((name for name in reversed(earlier) if verify(name).ok), None)
    advice = (f"newest earlier generation that verifies: {fallback}; resume from it with "
              f"--from-generation {fallback}") if fallback else "no earlier generation verifies"
    raise CorruptGeneration(f"generation {candidate.path.name} is damaged: {candidate.problem}; {advice}")
