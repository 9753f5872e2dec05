"""Which backend holds a run directory: the one place that asks."""

from __future__ import annotations

from trainer.checkpoint.signing import Signing, load_signing
from trainer.checkpoint.section import LocalSection, Section
from trainer.config import RunConfig, StoreConfig
from trainer.layout import GENERATIONS, SECTIONS, RunDirectory
from trainer.location import ClaimedByPrimary, OnDisk, InStore
from trainer.storage.base import RunStorage
from trainer.storage.local import LocalStorage
from trainer.parallel.launch import LaunchEnvironment
from trainer.storage.memory.parts import Place
from trainer.storage.memory.tier import MemoryDirTier, MemoryTier, NoMemoryTier


def open_storage(config: RunConfig, launch: LaunchEnvironment) -> RunStorage:
    """The backend of the run directory (`open_backend`)."""
    return open_backend(config, launch.world_size)


def open_memory_tier(config: RunConfig, launch: LaunchEnvironment, signing: Signing | None) -> MemoryTier:
    """Tier 0 (storage/memory/tier.py), ahead of the backend in restores and beside it in saves:
    a `MemoryDirTier` with `--memory-dir`, else a `NoMemoryTier`. `signing`: the backend's."""
    if config.memory.directory is None:
        return NoMemoryTier()
    return MemoryDirTier(config.memory, signing,
                         Place(launch.rank, launch.world_size, launch.local_world_size, launch.local_rank))


def open_backend(config: RunConfig, processes: int) -> RunStorage:
    """`--output DIR`: this disk. `--output s3://…`: the object store, with its local tier on
    this machine; tiered for one process, direct for several."""
    signing = load_signing(config.signing)  # the backend holds the key (cli.py read it first, to fail early)
    match config.location:
        case OnDisk(root):
            return LocalStorage(RunDirectory(root), signing)
        case ClaimedByPrimary():  # joins rank 0's run directory once it is claimed
            return LocalStorage(RunDirectory(None), signing)
        case InStore(store, local_tier):
            from trainer.storage.object.backend import open_object_storage

            return open_object_storage(store, RunDirectory(local_tier), config.store_config, config.retention,
                                       processes, signing)


def generations_of(location: OnDisk | InStore, settings: StoreConfig = StoreConfig()) -> Section:
    """The committed generations of a run directory, wherever it lives: a `LocalSection` or an
    `ObjectSection`, both able to `copy_committed` a generation from a section like them and to
    `adopt` another run's generations (`ops restart --copy`'s seeding)."""
    match location:
        case OnDisk(root):
            return LocalSection(RunDirectory(root).section(GENERATIONS))
        case InStore(store):
            from trainer.storage.object.client import open_objects
            from trainer.storage.object.section import ObjectSection

            return ObjectSection(open_objects(store, settings), SECTIONS[GENERATIONS])
