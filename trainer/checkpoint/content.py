"""Commits check content, not sizes: what rank 0 commits is exactly what the ranks wrote.

Every rank hashes its shards while writing them (checkpoint/writer.py) and reports
`{file: {bytes, digest}}` (checkpoint/digest.py); rank 0 commits a generation only when what the disk or the object
store holds has those very bytes. A size check alone let a late object of the same size (a
zombie rank of an earlier attempt uploading into the same `step-%08d/` prefix, another
process writing into the generation) be committed under a manifest that then failed every
verification; now the commit refuses it (exit 74, one line naming the file and the rank).

Where the bytes are read again, and why:
* one disk: rank 0 hashes every file while sealing (with one process the writer's own
  digests stand: no other process writes into this attempt's fresh temporary);
* an object store: rank 0 streams every object through the digest before writing the manifest.
  The store's own checksums do not say the same thing: an S3 ETag is the MD5 of the object
  only for a single-part upload without SSE-KMS, a multipart one is the MD5 of the parts'
  MD5s (SeaweedFS does the same, measured), and our writers hash BLAKE3, not MD5; comparing
  ETags would need a second hash of every byte on every rank and a fallback for the stores
  where ETags are opaque anyway. The re-read costs rank 0 one streamed download of the
  generation (on the committer thread for an async save).

The check runs right before the manifest is written; an object replaced after it (a window
of one manifest write) is caught by verification at the next restore (exit 65), never used.
"""

from __future__ import annotations

from typing import Mapping

from trainer.checkpoint.digest import algorithm_of, value_of
from trainer.errors import StorageFailure


class ContentMismatch(StorageFailure):
    """The disk or the store holds other bytes than a rank wrote: not committed (exit 74)."""


def writers_of(reports: list[Mapping[str, dict]]) -> dict[str, int]:
    """Which rank wrote each file, from every rank's report in rank order."""
    return {file: rank for rank, files in enumerate(reports) for file in files}


def merged(reports: list[Mapping[str, dict]]) -> dict[str, dict]:
    """Every rank's `{file: {bytes, digest}}` as one listing."""
    return {file: dict(entry) for files in reports for file, entry in files.items()}


def first_mismatch(expected: Mapping[str, dict], held: Mapping[str, dict | None]) -> tuple[str, dict | None] | None:
    """The first file (in name order) whose held `{bytes, digest}` differs from the one
    written (None: it is not there), or None when every file holds exactly its bytes."""
    for file in sorted(expected):
        found, written = held.get(file), expected[file]
        algorithm = algorithm_of(written)
        if found is None or found["bytes"] != written["bytes"] or found.get(algorithm) != written[algorithm]:
            return file, found
    return None


def check_content(expected: Mapping[str, dict], held: Mapping[str, dict | None], where: str,
                  writers: Mapping[str, int], name: str) -> None:
    """Raise ContentMismatch (one line: the file, the rank that wrote it, both digests) unless
    `held` has exactly the bytes `expected` lists."""
    mismatch = first_mismatch(expected, held)
    if mismatch is None:
        return
    file, found = mismatch
    wrote = f"rank {writers[file]} wrote" if file in writers else "was written"
    written = expected[file]
    if found is None:
        state = "is missing"
    else:
        algorithm = algorithm_of(written)
        state = (f"holds other bytes than {wrote} ({algorithm} {str(found.get(algorithm, '?'))[:12]}…, "
                 f"{found['bytes']} bytes; written: {algorithm} {value_of(written)[:12]}…, {written['bytes']} bytes)")
    raise ContentMismatch(f"{where}/{file} {state}: another writer replaced it (a zombie rank of an earlier "
                          f"attempt?); {name} was not committed; rerun with --resume auto")


def checking(describe, reports: list[Mapping[str, dict]], where: str, name: str):
    """`describe` (files → manifest) that first refuses files whose bytes differ from what
    their rank reported: a sealer calls it before writing the manifest, so nothing is sealed."""
    expected, writers = merged(reports), writers_of(reports)

    def check_then_describe(files: dict):
        check_content(expected, files, where, writers, name)
        return describe(files)
    return check_then_describe
