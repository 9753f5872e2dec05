"""`list`, `verify`, `report` and `compare.py`'s inputs when the run directory lives in a store
(`s3://BUCKET/RUN`): the same tables, lines and exit codes as for a local run, built from the
objects. Read-only: nothing here takes the lease or writes an object.

`list` trusts the commit protocol (a generation is committed iff its manifest object exists)
and reads one manifest per generation, so it costs a listing plus one small read each;
`verify` downloads each generation into a temporary folder, hashing every object as it
arrives, loads every stored value from there through the safe loader, and deletes the copy.
"""

from __future__ import annotations

import json
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from trainer.location import StoreLocation
from trainer.run.records import RUNNING, AttemptRecord, read_attempt_records
from trainer.config import StoreConfig
from trainer.errors import NothingToResume, UsageError
from trainer.inspect.listing import attempt_rows, local_row, publish_costs, sealed_row
from trainer.checkpoint.atomic import manifest_digest
from trainer.checkpoint.manifest import RECOVERY, InvalidManifest, Manifest, Verification
from trainer.checkpoint.section import LocalSection
from trainer.checkpoint.signing import Signing
from trainer.storage.object.lease import LEASE
from trainer.storage.object.client import ObjectClient, open_objects
from trainer.storage.object.section import ObjectSection, digest_of
from trainer.layout import ATTEMPTS, GENERATIONS, SECTIONS, RunDirectory, generation_step
from trainer.storage.object.tiering import RemoteRun

READ_CONFIG = StoreConfig(retries=2, timeout_s=10.0)
"""A command a person runs says "unreachable" within seconds; the trainer's longer retry
bound is for unattended runs."""


def open_store(location: StoreLocation) -> ObjectClient:
    """The run's objects, once the bucket answered (74 unreachable or refused, 66 no bucket)."""
    objects = open_objects(location, READ_CONFIG)
    objects.check_reachable()
    return objects


def sealed_target(location: StoreLocation) -> tuple[StoreLocation, str, str] | None:
    """(run, section folder, name) when the URL names one generation or export
    (`…/RUN/checkpoints/step-00000064`); None when it names a run."""
    parts = location.prefix.split("/")
    if len(parts) < 2 or parts[-2] not in SECTIONS.values() or generation_step(parts[-1]) is None:
        return None
    return StoreLocation(location.scheme, location.bucket, "/".join(parts[:-2])), parts[-2], parts[-1]


def store_attempts(objects: ObjectClient) -> list[AttemptRecord]:
    """The attempt records in the store, read by the local code from a temporary copy."""
    with tempfile.TemporaryDirectory(prefix="trainer-attempts-") as folder:
        RemoteRun(objects, RunDirectory(Path(folder))).pull_attempts()
        return read_attempt_records(Path(folder))


# ----------------------------------------------------------------------------- list
def describe_store_run(location: StoreLocation, tier: Path, signing: Signing | None = None) -> dict:
    """`list`'s description of a run in a store: its committed generations and exports, plus
    the ones this machine's local tier published that are not durable (yet); per row whether it
    is durable and whether the local tier holds the same copy."""
    objects = open_store(location)
    attempts = store_attempts(objects)
    described = {"output": objects.url, "store": objects.url, "local_tier": str(tier),
                 "local_tier_found": tier.is_dir()}
    for section, folder in SECTIONS.items():
        remote = ObjectSection(objects, folder, signing)
        scan = remote.scan()
        described[section] = section_rows(remote, scan.committed, LocalSection(tier / folder, signing),
                                          publish_costs(attempts, section))
        described.update({f"{section}_uncommitted": scan.uncommitted, f"{section}_temporary": [],
                          f"{section}_replaced": scan.set_aside, f"{section}_replacing": []})
    described["attempts"] = attempt_rows(attempts)
    if not any(described[section] or described[f"{section}_uncommitted"] or described[f"{section}_replaced"]
               for section in SECTIONS) and not attempts:
        raise NothingToResume(f"nothing under {objects.url}: no generations, exports or attempt records; "
                              f"pass the --output URL of a run")
    return described


def section_rows(remote: ObjectSection, committed: list[str], local: LocalSection,
                 costs: dict[str, dict]) -> list[dict]:
    """Committed rows from the store, then local-only rows re-hashed here, in step order. A
    local-only copy older than the store's newest generation is `stale` (the store's retention
    removed it, or another node's trainer went on), not a generation waiting for its upload."""
    rows = [row for name in committed if (row := committed_row(remote, name, local, costs))]
    newest = max(committed, default="")
    for name in local.names():
        if name not in committed and (row := local_row(local, name, costs)):
            rows.append({**row, "durable": False, "local": "stale" if name < newest else "only"})
    return sorted(rows, key=lambda row: row["name"])


def committed_row(remote: ObjectSection, name: str, local: LocalSection, costs: dict[str, dict]) -> dict | None:
    """A committed directory's row from its manifest alone (sizes included); None if it was
    removed since the listing (a live trainer's retention)."""
    data = remote.manifest_bytes(name)
    if data is None:
        return None
    try:
        manifest, problem = Manifest.from_json(json.loads(data)), None
    except (InvalidManifest, ValueError) as reason:
        manifest, problem = None, f"manifest.json: {reason}"
    size = len(data) + (sum(int(entry["bytes"]) for entry in manifest.files.values()) if manifest else 0)
    row = sealed_row(name, manifest, size, costs, None if manifest else False, problem)
    return {**row, "durable": True, "local": local_copy(local, name, digest_of(data))}


def local_copy(local: LocalSection, name: str, committed_digest: str) -> str:
    """"same" when the local tier's manifest bytes are the committed ones, else "different" or "absent"."""
    if name not in local.names():
        return "absent"
    try:
        return "same" if manifest_digest(local.path(name)) == committed_digest else "different"
    except OSError:
        return "absent"


# ----------------------------------------------------------------------------- verify
def store_verifications(location: StoreLocation, signing: Signing | None = None) -> list[tuple[str, Verification]]:
    """Judge every committed generation and export (or the one the URL names) as `--resume`
    would (`judged_in_store`): the local verify's lines and exit codes (65 on damage)."""
    target = sealed_target(location)
    objects = open_store(target[0] if target else location)
    if target:
        section = ObjectSection(objects, target[1], signing)
        if section.manifest_bytes(target[2]) is None:
            raise NothingToResume(f"{location.url} is not a committed generation or export (no manifest.json object); "
                                  f"`python -m trainer list` shows what is")
        found = [(section, target[2])]
    else:
        sections = [ObjectSection(objects, folder, signing) for folder in SECTIONS.values()]
        found = [(section, name) for section in sections for name in section.committed()]
    if not found:
        raise NothingToResume(f"no committed generations or exports under {objects.url}")
    return [(section.url(name), judged_in_store(section, name)) for section, name in found]


def judged_in_store(section: ObjectSection, name: str) -> Verification:
    """Every check `--resume` applies: the objects' digests as they download into a temporary
    folder, name, run and signature, then every stored value loaded from there through the
    safe loader (`judged_by_loading`); the copy is deleted."""
    with tempfile.TemporaryDirectory(prefix="trainer-verify-") as scratch:
        copy = Path(scratch) / name
        copy.mkdir()
        verification = section.verify(name, into=copy)
        if not verification.ok or verification.manifest.kind != RECOVERY:
            return verification
        from trainer.checkpoint.onepass import judged_by_loading

        return judged_by_loading(verification, copy)


# ----------------------------------------------------------------------------- report
def store_report(location: StoreLocation):
    """The recovery report from the store's attempt records (pushed at start and after every
    commit). A `running` record is live only while its attempt holds the lease; a killed one's
    wall time is estimated up to its last publish (the objects' times say nothing better)."""
    from trainer.inspect.report import build_report

    objects = open_store(location)
    records = store_attempts(objects)
    if not records:
        raise NothingToResume(f"no attempt records under {objects.url_of(ATTEMPTS)}; pass the --output URL of a "
                              f"run that has trained")
    running = {record.id for record in records if record.status == RUNNING}
    return build_report(records, frozenset(running & {leased_attempt(objects)}))


def leased_attempt(objects: ObjectClient) -> str | None:
    """The attempt whose trainer holds the lease now: it renewed it less than its ttl ago and has
    not released it. Every
    holder renews, on whichever host it runs, so this sees a pod elsewhere (as far as the two
    machines' clocks agree, to a second or so), which a local run's lock file cannot."""
    data = objects.read(LEASE)
    try:
        holder = json.loads(data) if data is not None else {}
        if holder.get("released"):  # the holder ended and let go
            return None
        renewed = datetime.strptime(holder["renewed_utc"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
        return str(holder["attempt"]) if time.time() - renewed.timestamp() < float(holder["ttl_s"]) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# ----------------------------------------------------------------------------- compare
def local_generation(location: StoreLocation, parent: Path) -> Path:
    """The generation a URL names, downloaded into `parent`, every object verified as it
    streams. Damage is an unusable input (UsageError), as for a local one."""
    where = location.url
    target = sealed_target(location)
    if target is None:
        committed = sorted(ObjectSection(open_store(location), SECTIONS[GENERATIONS]).committed())
        if committed:
            raise UsageError(f"{where} is a run, not a generation; pass {where.rstrip('/')}/"
                             f"{SECTIONS[GENERATIONS]}/{committed[-1]} (its newest generation)")
        raise UsageError(f"{where} names no generation; pass e.g. s3://BUCKET/RUN/checkpoints/step-00000064")
    run, folder, name = target
    verification, _ = ObjectSection(open_store(run), folder).fetch(name, parent)
    if not verification.ok:
        raise UsageError(f"{where} cannot be compared: {verification.problem}")
    return verification.path
