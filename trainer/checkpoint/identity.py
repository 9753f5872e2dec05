"""Which run a generation belongs to, and the checks every reader of one applies.

A run directory holds `run.json`, created with it (its first claim): a random run id and the
runs whose generations an operator adopted. Copies of the whole directory keep it (`cp -a`,
`aws s3 sync`). Every manifest the trainer writes names the run (`"run"`; signed with the rest
when a key is configured), so a generation copied in from another run is refused (65) even
when one key signs both runs, which is likely: one Secret serves a team. The deliberate ways
to continue from another run's generation are explicit and recorded in `run.json`:
`--adopt-from RUN` (an operator), and `polyaxon ops restart --copy`'s seeding.

`trusted` is the one check of name, run and signature behind `--resume`, `verify` and `list`,
for a local directory and for a store alike, so they cannot disagree about a generation.

A generation without a run id was written before run ids existed: it is accepted as the run's
own (there is nothing to compare), and with a signing key its signature still holds.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass

from trainer.checkpoint.manifest import Manifest, Verification
from trainer.checkpoint.signing import Signing, authenticated
from trainer.errors import CorruptGeneration
from trainer.layout import MANIFEST, RUN_IDENTITY, generation_step

ADOPT_OPTION = "--adopt-from"
FOREIGN = "belongs to run"


class InvalidIdentity(ValueError):
    """`run.json` cannot be read as a run identity; the message says why."""


@dataclass(frozen=True)
class Adoption:
    """Generations of another run this run continues from, on purpose."""

    run: str
    attempt: str
    """The attempt that adopted it (or the copy's seeding)."""
    how: str
    """`--adopt-from`, or `polyaxon ops restart --copy of run UUID`."""


@dataclass(frozen=True)
class RunIdentity:
    run: str
    adopted: tuple[Adoption, ...] = ()

    @classmethod
    def new(cls) -> "RunIdentity":
        return cls(secrets.token_hex(8))

    def accepts(self, run: str | None) -> bool:
        """A generation of this run, of one it adopted, or one written before run ids."""
        return run is None or run == self.run or any(adoption.run == run for adoption in self.adopted)

    def adopting(self, run: str, attempt: str, how: str) -> "RunIdentity":
        if self.accepts(run):
            return self
        return dataclasses.replace(self, adopted=self.adopted + (Adoption(run, attempt, how),))

    def to_bytes(self) -> bytes:
        return (json.dumps({"run": self.run, "adopted": [dataclasses.asdict(a) for a in self.adopted]},
                           indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "RunIdentity":
        try:
            value = json.loads(data)
            adopted = tuple(Adoption(str(a["run"]), str(a["attempt"]), str(a["how"])) for a in value["adopted"])
            if not isinstance(value["run"], str) or not value["run"]:
                raise ValueError("no run id")
            return cls(value["run"], adopted)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
            raise InvalidIdentity(f"{RUN_IDENTITY}: unreadable ({error.__class__.__name__}: {error})") from None


def identity_or_problem(data: bytes | None) -> tuple[RunIdentity | None, str | None]:
    """The identity `run.json`'s bytes hold (None without the file), or why they hold none."""
    if data is None:
        return None, None
    try:
        return RunIdentity.from_bytes(data), None
    except InvalidIdentity as problem:
        return None, str(problem)


def adopted(own: bytes | None, run: str, attempt: str, how: str) -> bytes:
    """The bytes of a run's `run.json` (`own`; a new identity without one) adopting `run`'s
    generations, recorded with `attempt` and `how`; CorruptGeneration when `own` is unreadable."""
    identity, problem = identity_or_problem(own)
    if problem:
        raise CorruptGeneration(f"this run's {RUN_IDENTITY} is {problem.split(': ', 1)[1]}; remove it")
    return (identity or RunIdentity.new()).adopting(run, attempt, how).to_bytes()


def naming_problem(name: str, manifest: Manifest) -> str | None:
    """A directory verifies under its name only if its manifest describes that name: a
    generation copied or renamed to another step would otherwise be restored as a newer one,
    and every later resume would replay from its real step. (A directory not named like a
    generation, which nothing selects by name, is checked by its content alone.)"""
    if generation_step(name) is not None and (manifest.name != name or manifest.step != generation_step(name)):
        return (f"{MANIFEST}: describes {manifest.name} (step {manifest.step}), not {name}; "
                f"a copied or renamed directory")
    return None


def foreign_problem(manifest: Manifest, identity: RunIdentity | None) -> str | None:
    if identity is None or identity.accepts(manifest.run):
        return None
    return (f"{MANIFEST}: {FOREIGN} {manifest.run}, not to this run ({identity.run}): copied in from another "
            f"run; to continue from it on purpose, adopt it with {ADOPT_OPTION} {manifest.run} (recorded in "
            f"{RUN_IDENTITY})")


def is_foreign(problem: str | None) -> bool:
    return bool(problem) and problem.startswith(f"{MANIFEST}: {FOREIGN} ")


def trusted(verification: Verification, name: str, identity: RunIdentity | None, identity_problem: str | None,
            signing: Signing | None) -> Verification:
    """`verification` (a directory or prefix whose structure was checked), failed unless its
    manifest describes `name`, belongs to this run (`identity`; None: no run to compare with)
    and, with a key, is signed by it. The one check behind resume, `verify` and `list`."""
    manifest = verification.manifest
    if not verification.ok or manifest is None:
        return verification
    problem = naming_problem(name, manifest) or identity_problem or foreign_problem(manifest, identity)
    if problem:
        return dataclasses.replace(verification, problem=problem)
    return authenticated(verification, signing)
