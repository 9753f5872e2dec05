"""Committing a generation in an object store from several processes that share no disk
(pods of a PyTorchJob, each with its own disk): the `Commit` strategy of checkpoint/commit.py.

Every rank writes its own DCP shards into a scratch directory on its own disk (rank 0 also
writes DCP's `.metadata`), hashing while it writes, and uploads them under the generation's
prefix; the ranks then exchange their `{file: {bytes, digest}}` and whether their upload
succeeded, and rank 0 checks that the store holds exactly the bytes each rank wrote (its
digest, checkpoint/content.py) and commits the manifest, behind its lease's fence. No node ever holds a complete local copy, so the scratch
is deleted after the upload and every rank restores by downloading, verified while streaming.

The exchange runs on the coordinator the checkpointer hands over: in the loop for a sync save
(durable when `save()` returns), on a gloo group of its own for an async one (the loop goes
on while the shards upload). Only rank 0 holds the lease and fences; the other ranks' data
objects land under a prefix that nothing selects until rank 0 commits.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from trainer.checkpoint.atomic import file_digest
from trainer.checkpoint.commit import Committed, Describe
from trainer.checkpoint.content import merged, writers_of
from trainer.checkpoint.coordination import Coordinator, raise_if_any_failed
from trainer.checkpoint.section import LocalSection
from trainer.checkpoint.signing import encode_signed
from trainer.errors import reraise_as_storage_failure, storage_failure
from trainer.layout import SNAPSHOT_INDEX, generation_name, temporary_name
from trainer.storage.object.lease import lost_lease
from trainer.storage.object.section import ObjectSection, digest_of


class ObjectCommit:
    """Each rank uploads its own shards; rank 0 commits the manifest (fenced)."""

    mode_suffix = "-store"

    def __init__(self, target: ObjectSection, scratch: LocalSection, fence: Callable[[], None],
                 max_pending: int):
        self.target = target
        self.local = scratch
        self.fence = fence
        self.max_pending = max(1, max_pending)
        """Generations written and still uploading at once (`--max-pending-uploads`), async only."""

    def begin(self, step: int, attempt_id: str, coordinator: Coordinator) -> Path:
        name = generation_name(step)
        token = coordinator.decide_on_primary(lambda: self._prepare(name, attempt_id), f"preparing generation {name}")
        # One scratch per rank: ranks on one node share its local tier, and each deletes its
        # scratch once its own upload is done.
        scratch = self.local.root / f"{token}-rank{coordinator.rank}"
        failure = None
        try:
            scratch.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            failure = storage_failure(error, f"creating the scratch of generation {name} on this node")
        raise_if_any_failed(coordinator, failure, f"preparing generation {name}")  # a full disk on one node stops all
        return scratch

    def _prepare(self, name: str, attempt_id: str) -> str:
        """Rank 0: the prefix is ours to fill (fenced), emptied of leftovers; the scratch name."""
        self.fence()
        self.target.clear(name)
        return temporary_name(name, attempt_id)

    def commit(self, temporary: Path, step: int, describe: Describe, digests: dict[str, dict],
               coordinator: Coordinator) -> Committed:
        name = generation_name(step)
        files, failure, started = dict(digests), None, time.monotonic()
        try:
            if coordinator.is_primary:
                files[SNAPSHOT_INDEX] = file_digest(temporary / SNAPSHOT_INDEX, sync=True)
            fence = self.fence if coordinator.is_primary else (lambda: None)
            self.target.upload_files(name, temporary, sorted(files), fence)
        except BaseException as error:  # noqa: BLE001 - every rank must hear of it, below
            failure = error
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
        uploaded = (files, time.monotonic() - started)
        raise_if_any_failed(coordinator, failure, f"uploading generation {name} to {self.target.url(name)}")
        every = coordinator.gather(uploaded, f"gathering the shards of {name}")
        digest = coordinator.decide_on_primary(lambda: self._commit_manifest(name, describe, every),
                                               f"committing generation {name}")
        return Committed(digest, max(upload_s for _, upload_s in every))

    def _commit_manifest(self, name: str, describe: Describe, every: list[tuple[dict, float]]) -> str:
        reports = [rank_files for rank_files, _ in every]
        files = merged(reports)
        data = encode_signed(self.target.owned(describe(dict(sorted(files.items())))).to_json(), self.target.signing)
        try:
            self.target.commit_manifest(name, data, files, self.fence, writers_of(reports))
        except BaseException as error:
            lost = lost_lease(self.fence)  # a takeover explains any failure that follows it
            if lost is not None:
                raise lost from None
            reraise_as_storage_failure(error, f"committing generation {name} to {self.target.url(name)}")
        return digest_of(data)

    def abandon(self, temporary: Path, coordinator: Coordinator) -> None:
        shutil.rmtree(temporary, ignore_errors=True)
