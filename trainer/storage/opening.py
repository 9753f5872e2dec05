"""Which backend holds a run directory: the one place that asks."""

from __future__ import annotations

from trainer.checkpoint.signing import load_signing
from trainer.config import RunConfig
from trainer.layout import RunDirectory
from trainer.storage.base import RunStorage
from trainer.storage.local import LocalStorage
from trainer.storage.location import parse_store_url


def open_storage(config: RunConfig, processes: int) -> RunStorage:
    """`--output DIR`: this disk. `--output s3://…`: the object store, with `config.output` as
    this machine's local tier; tiered for one process, direct for several."""
    signing = load_signing(config.signing)  # read once: the key file is never read again
    if config.store is None:
        return LocalStorage(RunDirectory(config.output), signing)
    from trainer.storage.object.backend import open_object_storage

    return open_object_storage(parse_store_url(config.store), RunDirectory(config.output), config.store_config,
                               config.retention, processes, signing)
