"""The run's lineage in Polyaxon: one reference per published generation (`dir`) and export
(`model`), carrying our manifest digest, and deleted again when retention deletes what it names.

Polyaxon does not re-hash the files and keeps the path relative to the run. Every failure here
is one warning line: the generation stands, the lineage only shows it. tracking.py decides when
a reference is made (published, or once the store holds it) and where it points.
"""

from __future__ import annotations

import logging

from trainer.integrations.polyaxon.retries import call, one_line

log = logging.getLogger("trainer")


def lineage_name(kind: str, name: str) -> str:
    """The lineage reference of a published generation or export."""
    return f"{'export' if kind == 'export' else 'generation'}-{name}"


def reference(run, kind: str, location: str, published) -> None:
    """Reference a published generation or export (a `Published`) at `location`."""
    summary = {"hash": published.manifest_sha256, "hash_of": "manifest.json (sha256)", "step": published.step}
    try:  # each post answered before the next, retried on the sandbox's 405 (internals.py)
        if kind == "export":
            run.log_model_ref(location, name=lineage_name(kind, published.name), framework="safetensors",
                              summary=summary, skip_hash_calculation=True)
        else:
            run.log_artifact_ref(location, kind="dir", name=lineage_name(kind, published.name),
                                 hash=published.manifest_sha256, summary=summary, skip_hash_calculation=True)
    except Exception as error:  # noqa: BLE001 - the generation stands; the lineage only shows it
        log.warning("tracking: could not add %s %s to the lineage of run %s: %s", kind, published.name,
                    run.run_uuid, one_line(error))


def reference_seed(run, location: str, seed) -> None:
    """Reference the generation a copy was seeded with (a `copy_seed.CopiedFrom`), with the
    original's manifest digest and the run it came from."""
    summary = {"hash": seed.manifest_sha256, "hash_of": "manifest.json (sha256)", "copied_from": seed.run}
    try:
        run.log_artifact_ref(location, kind="dir", name=lineage_name("generation", seed.generation),
                             hash=seed.manifest_sha256, summary=summary, skip_hash_calculation=True)
    except Exception as error:  # noqa: BLE001 - the seed stands; the lineage only shows it
        log.warning("tracking: could not reference the seeded %s of run %s: %s", seed.generation,
                    run.run_uuid, one_line(error))


def remove_reference(run, mode: str, kind: str, name: str) -> None:
    """Drop the reference of a generation or export retention deleted. Offline the client keeps
    the references in `artifacts_lineage` (written to lineages.plx.json when the run ends);
    managed, the API deletes the row."""
    reference_name = lineage_name(kind, name)
    try:
        if mode == "offline":
            run.artifacts_lineage.pop(reference_name, None)
        else:
            call(run.client.runs_v1.delete_run_artifact_lineage, run.owner, run.project, run.run_uuid,
                 reference_name)
    except Exception as error:  # noqa: BLE001 - the deletion stands; say what the lineage still shows
        log.warning("tracking: %s was deleted, but its lineage reference %s stays: %s", name, reference_name,
                    one_line(error))
        return
    log.info("tracking: lineage reference %s removed", reference_name)
