"""Multi-process saves straight to a store, for ranks that share no filesystem (pods of a
PyTorchJob, each with its own disk).

Every rank writes its own DCP shards into a scratch directory on its own disk (rank 0 also
writes DCP's `.metadata`), hashing while it writes, and uploads them; rank 0 gathers every
rank's `{file: {bytes, sha256}}`, checks the store holds them, and commits the manifest,
which names the attempt. The generation is durable when `save()` returns; the scratch
copies are deleted (no node holds a complete local copy to restore from: every rank restores
by downloading, verified while streaming).

Only rank 0 holds the lease and fences its commit; the other ranks' data objects land under
a prefix that nothing selects until rank 0 commits.
"""

from __future__ import annotations

import shutil
import time
from typing import Callable

from trainer import seams
from trainer.errors import TrainerError, reraise_as_storage_failure
from trainer.checkpoint.atomic import file_digest
from trainer.checkpoint.signing import encode_signed
from trainer.checkpoint.coordination import Coordinator
from trainer.checkpoint.manifest import GenerationFacts, Manifest
from trainer.checkpoint.snapshot import write_snapshot
from trainer.checkpoint.section import LocalSection, Published
from trainer.checkpoint.writer import WriterConfig
from trainer.storage.object.section import ObjectSection, digest_of
from trainer.layout import SNAPSHOT_INDEX, generation_name, temporary_name


class DirectCheckpointer:
    """A `Checkpointer` whose generations are committed in the object store when `save()`
    returns; `local` is this rank's scratch (nothing is published there)."""

    mode = "sync"

    def __init__(self, target: ObjectSection, scratch: LocalSection, attempt_id: str,
                 coordinator: Coordinator, fence: Callable[[], None] | None,
                 config: WriterConfig = WriterConfig()):
        self.target = target
        self.local = scratch
        self.attempt_id = attempt_id
        self.coordinator = coordinator
        self.fence = fence if fence is not None else (lambda: None)
        self.config = config

    def save(self, state_dict: dict, facts: GenerationFacts) -> list[Published]:
        started = time.monotonic()
        coordinator, name = self.coordinator, generation_name(facts.step)
        token = coordinator.decide_on_primary(lambda: self._prepare(name), f"preparing generation {name}")
        scratch = self.local.root / token
        try:
            scratch.mkdir(parents=True, exist_ok=True)
            files = write_snapshot(state_dict, scratch, self.config)
            seams.crash_point("after-write")
            if coordinator.is_primary:
                files[SNAPSHOT_INDEX] = file_digest(scratch / SNAPSHOT_INDEX, sync=True)
            written = time.monotonic()
            self.target.upload_files(name, scratch, sorted(files), lambda: None)
            uploaded = time.monotonic()
            every = coordinator.gather(files, f"gathering the shards of {name}")
            timings = {"write_s": written - started, "upload_s": uploaded - written}
            digest = coordinator.decide_on_primary(lambda: self._commit(name, facts, every, timings),
                                                   f"committing generation {name}")
        except BaseException as error:
            if isinstance(error, TrainerError):
                raise
            reraise_as_storage_failure(error, f"writing generation {name} to {self.target.url(name)}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        elapsed = time.monotonic() - started
        return [Published(name, facts.step, digest, elapsed, elapsed)]

    def _prepare(self, name: str) -> str:
        """Rank 0: the prefix is ours to fill (fenced), emptied of leftovers; the scratch name."""
        self.fence()
        self.target.clear(name)
        return temporary_name(name, self.attempt_id)

    def _commit(self, name: str, facts: GenerationFacts, every: list[dict], timings: dict) -> str:
        files = {file: entry for rank_files in every for file, entry in rank_files.items()}
        manifest = Manifest.for_generation(facts, self.attempt_id, {"mode": "sync-store", **timings},
                                           dict(sorted(files.items())))
        data = encode_signed(manifest.to_json(), self.target.signing)
        self.target.commit_manifest(name, data, files, self.fence)
        return digest_of(data)

    def wait_for_staging(self) -> float:
        return 0.0

    def finalize(self) -> list[Published]:
        return []

    def close_after_failure(self) -> list[Published]:
        return []
