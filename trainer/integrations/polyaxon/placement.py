"""Where a `--tracked` run keeps its run directory: straight in the Polyaxon run's artifacts
store when the container can reach it, else in the sidecar-synced outputs path.

In the store the run directory is `<store path>/training-recovery/<run uuid>`: beside the run's
own folder `<store path>/<run uuid>`, never inside it. Polyaxon writes into that folder from
outside the trainer: the init step of `ops restart --copy` copies the original's whole folder
into the new run's context, and the sidecar uploads the context to `<store path>/<new uuid>`
whenever it next syncs, unverified and after the trainer started. A run directory inside it
would be raced by that copy (the original's generations, attempts and lease object landing
under the live run); beside it, nothing of Polyaxon's reaches it (copy_seed.py seeds a copy).

Polyaxon (2.18) gives the main container the artifacts store's connection only with
`plugins: {mountArtifactsStore: true}` (the polyaxonfiles here set it): the connection catalog
(POLYAXON_CONNECTIONS_CATALOG, JSON), the store's name (POLYAXON_ARTIFACTS_STORE_NAME), the
connection's secret as environment variables (or its files at `secret.mountPath`), and a
volume store mounted at its `schema.mountPath`.

- **Bucket store** (s3, gcs, wasb): the run directory is a store URL, so every
  generation is durable in the store once its manifest is committed there (no sidecar in
  between), and the working copy (local tier) is `$TRAINER_LOCAL_TIER/<run uuid>` (the
  polyaxonfiles mount an emptyDir at /local-tier), never under the context's artifacts folder
  (`$POLYAXON_CONTEXT_ROOT/artifacts`): the sidecar would upload it a second time, and delete
  from the store what the trainer removes.
- **Volume store** (host_path, volume_claim, mounted): the run directory is the local path
  `<mountPath>/training-recovery/<run uuid>`, written and fsynced there directly (a shared
  filesystem: the lock applies as for any local directory).
- **Nothing exposed** (a polyaxonfile without mountArtifactsStore): the outputs path as before,
  with one warning in a managed run: a generation is then only as durable as the sidecar's
  next sync.

Every rank resolves the same place from its own environment (a PyTorchJob's pods share no
filesystem), so the run uuid comes from POLYAXON_RUN_INSTANCE, which the agent sets in every
container; a single offline process may use the uuid its own tracking run was given.

Imported only with `--tracked` (it reads Polyaxon's connection schema).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from trainer.errors import UsageError
from trainer.location import LOCAL_TIER_ENV, OnDisk, Location, StoreLocation, InStore, parse_store_url

CATALOG_ENV = "POLYAXON_CONNECTIONS_CATALOG"
STORE_NAME_ENV = "POLYAXON_ARTIFACTS_STORE_NAME"
RUN_INSTANCE_ENV = "POLYAXON_RUN_INSTANCE"
MANAGED_ENV = "POLYAXON_IS_MANAGED"
RUN_DIRECTORIES = "training-recovery"
"""The folder of the artifacts store that holds every tracked run's run directory, by run uuid."""
BUCKET_SCHEMES = {"s3": "s3", "gcs": "gs", "wasb": "az"}
"""Polyaxon's bucket kinds and the store URL scheme the trainer uses for each."""
WASB = re.compile(r"^wasbs?://(?P<container>[^@/]+)@(?P<account>[^.]+)\.blob\.core\.windows\.net(?:/|$)")
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
MOUNT_HINT = ("set `plugins: {mountArtifactsStore: true}` in the polyaxonfile (as polyaxonfiles/*.yaml do) "
              "so the trainer writes generations straight to the artifacts store")


@dataclass(frozen=True)
class RunPlacement:
    """The run directory of a tracked run, as `--output` and `--local-tier` would give it."""

    location: Location | None
    """In a bucket (with this machine's local tier), a folder of a mounted volume, or None: the
    tracking run's outputs path (rank 0 opens it; other ranks learn it from rank 0)."""
    kind: str = "outputs"
    """bucket | volume | outputs (nothing exposed)."""
    connection: str | None = None
    """The artifacts store's connection name, when exposed."""
    environment: dict[str, str] = field(default_factory=dict)
    """Variables to export for the store's client (files of a mounted secret, WASB account),
    only those not already set."""
    warning: str | None = None
    """One line for rank 0 to log (nothing exposed, in a managed run)."""

    @property
    def in_store(self) -> bool:
        return self.location is not None and self.location.in_store

    @property
    def direct(self) -> bool:
        """The trainer writes where the store keeps the run's outputs (no sidecar in between)."""
        return self.kind in ("bucket", "volume")


def run_uuid_from(environ: Mapping[str, str], own_run_uuid: str | None, world_size: int) -> str:
    """The Polyaxon run every rank belongs to: POLYAXON_RUN_INSTANCE (`owner.project.runs.uuid`),
    else, for a single process, the uuid its tracking run was given."""
    instance = environ.get(RUN_INSTANCE_ENV)
    if instance:
        parts = instance.split(".")
        if len(parts) == 4 and parts[2] == "runs" and all(parts):
            return parts[3]
        raise UsageError(f"{RUN_INSTANCE_ENV}={instance!r} is not owner.project.runs.UUID; fix it, or unset it "
                         f"to start a new offline run")
    if own_run_uuid and world_size == 1:
        return own_run_uuid
    raise UsageError(f"--tracked under torchrun with the artifacts store exposed needs {RUN_INSTANCE_ENV} "
                     f"(owner.project.runs.UUID) in every process, so every rank finds the same run directory")


def artifacts_connection(environ: Mapping[str, str]):
    """The artifacts store's connection from the catalog Polyaxon put in the environment, or
    None when it is not exposed to this container."""
    name, catalog = environ.get(STORE_NAME_ENV), environ.get(CATALOG_ENV)
    if not name or not catalog:
        return None
    try:
        entries = json.loads(catalog).get("connections") or []
    except (ValueError, AttributeError):
        raise UsageError(f"{CATALOG_ENV} is not the JSON connection catalog Polyaxon writes "
                         f"({{\"connections\": [...]}}); fix or unset it") from None
    entry = next((e for e in entries if isinstance(e, dict) and e.get("name") == name), None)
    if entry is None:
        return None
    from polyaxon.schemas import V1Connection

    try:
        return V1Connection.from_dict(entry)
    except Exception as error:  # noqa: BLE001 - a schema error in a third-party model: say which
        raise UsageError(f"{CATALOG_ENV}: the connection {name!r} does not parse: "
                         f"{' '.join(str(error).split())[:200]}") from None


def store_url_of(connection) -> str:
    """The connection's store path as a store URL (Polyaxon gives WASB without a scheme)."""
    scheme = BUCKET_SCHEMES[connection.kind]
    path = connection.store_path.rstrip("/")
    if connection.kind == "wasb":
        return f"{scheme}://{path.split('://', 1)[-1]}"
    return path if "://" in path else f"{scheme}://{path}"


def client_environment(connection, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables the store's client reads that Polyaxon handed over in another form: the
    `AWS_*` files of a secret mounted at `secret.mountPath` (s3fs reads only the environment)
    and, for WASB, the account named in the bucket URL. Only those not set already."""
    found: dict[str, str] = {}
    secret = getattr(connection, "secret", None)
    folder = getattr(secret, "mount_path", None)
    if connection.kind == "s3" and folder and Path(folder).is_dir():
        for path in sorted(Path(folder).iterdir()):
            if path.name.startswith("AWS_") and ENV_NAME.match(path.name) and path.is_file():
                value = path.read_text().strip()
                if value:
                    found[path.name] = value
    if connection.kind == "wasb":
        match = WASB.match(connection.schema_.bucket or "")
        if match:
            found["AZURE_STORAGE_ACCOUNT_NAME"] = match.group("account")
    return {name: value for name, value in found.items() if not environ.get(name)}


def run_directory_in(volume: Path, run_uuid: str) -> Path:
    """The run directory of run `run_uuid` in a mounted volume store."""
    return volume / RUN_DIRECTORIES / run_uuid


def run_prefix_in(store: StoreLocation, run_uuid: str) -> StoreLocation:
    """The run directory of run `run_uuid` in a bucket store."""
    return store.child(f"{RUN_DIRECTORIES}/{run_uuid}")


def under(path: Path, folder: Path) -> bool:
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def place_run(environ: Mapping[str, str], own_run_uuid: str | None = None, world_size: int = 1,
              local_tier: Path | None = None) -> RunPlacement:
    """Where this rank's tracked run keeps its run directory (module docstring).

    `own_run_uuid`: the uuid of the tracking run rank 0 opened (None on other ranks);
    `local_tier`: an explicit `--local-tier`. Raises UsageError (exit 2) for a local tier the
    sidecar would upload, or a run uuid the ranks cannot agree on."""
    connection = artifacts_connection(environ)
    if connection is None or not (connection.is_bucket or connection.is_mount):
        warning = None
        if environ.get(MANAGED_ENV, "").lower() == "true":
            what = "is not exposed to this container" if connection is None else \
                f"({connection.kind}) is neither a bucket nor a mounted volume"
            warning = (f"the artifacts store {what}: generations are written to the outputs path and are only "
                       f"as durable as the sidecar's next sync of it; {MOUNT_HINT}")
        return RunPlacement(None, warning=warning)
    run_uuid = run_uuid_from(environ, own_run_uuid, world_size)
    if connection.is_mount:
        return RunPlacement(OnDisk(run_directory_in(Path(connection.store_path), run_uuid)), kind="volume",
                            connection=connection.name)
    location = run_prefix_in(parse_store_url(store_url_of(connection)), run_uuid)
    source = "--local-tier"
    if local_tier is None:
        parent = environ.get(LOCAL_TIER_ENV)
        source = f"{LOCAL_TIER_ENV}={parent}" if parent else "the default local tier"
        local_tier = Path(parent) / run_uuid if parent else location.default_local_tier()
    from trainer.integrations.polyaxon.internals import synced_context

    synced = synced_context()
    if under(local_tier, synced):
        raise UsageError(f"{source}: the local tier {local_tier} is under {synced}, which Polyaxon's "
                         f"sidecar uploads to the store a second time (and mirrors deletions of); point it at a "
                         f"volume of its own (the polyaxonfiles mount an emptyDir at /local-tier)")
    return RunPlacement(InStore(location, local_tier), kind="bucket", connection=connection.name,
                        environment=client_environment(connection, environ))

