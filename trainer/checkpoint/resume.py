"""Resume policy (README, "Resume policy and exit codes"): which generation, if any, a new process starts from.

`choose_candidate` is a pure decision over names; `verify_candidate` verifies the choice and
refuses a damaged one, naming the newest earlier generation that verifies.
"""

from __future__ import annotations

from typing import Callable

from trainer.errors import CorruptGeneration, NothingToResume, RefuseOverwrite, option
from trainer.checkpoint.identity import is_foreign
from trainer.checkpoint.manifest import Verification
from trainer.checkpoint.section import LocalSection


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
                                  f"continue with {option('--resume')}, or choose an empty {option('--output')}")
        return None
    if not names:
        if resume == "auto":
            return None
        raise NothingToResume(f"nothing to resume: no generation in {where}; "
                              f"start without {option('--resume')}, or use {option('--resume', 'auto')}")
    return names[-1]


def require_verified(candidate: Verification, earlier: list[str],
                     verify: Callable[[str], Verification]) -> None:
    """Refuse a damaged (or foreign) candidate, naming the newest earlier generation that verifies."""
    if candidate.ok:
        return
    fallback = next((name for name in reversed(earlier) if verify(name).ok), None)
    advice = (f"newest earlier generation that verifies: {fallback}; resume from it with "
              f"{option('--from-generation', fallback)}") if fallback else \
        f"no earlier generation verifies: move the damaged one aside to start over, or choose a new " \
        f"{option('--output')}"
    verdict = "is another run's" if is_foreign(candidate.problem) else "is damaged"
    raise CorruptGeneration(f"generation {candidate.name} {verdict}: {candidate.problem}; {advice}")


def verify_candidate(section: LocalSection, candidate: str, shards: bool = True) -> Verification:
    """The verified candidate, or CorruptGeneration (exit 65) with the way back. `shards`
    False: its shards' digest is left to the one-pass load (`shards_pending`), which refuses
    a damaged shard with `refuse_damaged`, the same line."""
    verification = section.verify(candidate, shards=shards)
    refuse_damaged(section, verification)
    return verification


def refuse_damaged(section: LocalSection, verification: Verification) -> None:
    """`require_verified` against the generations of `store` older than this one."""
    require_verified(verification, [name for name in section.names() if name < verification.name], section.verify)


def set_aside_later_line(generations: LocalSection, exports: LocalSection, step: int) -> list[str]:
    """An operator went back to the generation at `step`: every later generation and export
    belongs to an abandoned line. Set them aside as superseded copies (kept, never selected),
    so a later plain --resume cannot pick the abandoned line up again, and the new line never
    has to replace them. Returns them as "SECTION/NAME".

    Exports go first, then generations oldest first: a crash part way leaves the abandoned
    line's newest generation in place, so a plain --resume continues that line as if the
    operator had not gone back, and nothing newer than `step` is left in exports to outrank
    the new line's exports under retention."""
    return [f"{section.root.name}/{name}" for section in (exports, generations)
            for name in section.set_aside_later_than(step)]
