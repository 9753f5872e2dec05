"""The digest a manifest records for every file of a generation or an export.

New generations are digested with BLAKE3 (the `blake3` package); generations written before
it hold sha256 and still verify. Both are cryptographic: the manifest's signature (an
HMAC-SHA256 over its canonical bytes, trainer/checkpoint/signing.py) vouches for every file
through its digest, so a digest anyone can forge (a CRC, xxHash) would let a tampered file
pass under a valid signature. BLAKE3 costs a third of sha256's CPU on one thread (measured,
docs/checkpoint-modes.md), and that hash is the largest part of a sync save's CPU.

A file's entry names its algorithm by its key, `{"bytes": N, "blake3": HEX}` or
`{"bytes": N, "sha256": HEX}`, and the manifest names the one algorithm of all its entries
(`"digest"`): whoever hashes a file to check it hashes it with the algorithm its manifest
recorded.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import blake3

BLAKE3, SHA256 = "blake3", "sha256"
CURRENT = BLAKE3
"""What every new generation, export and tier-0 part is digested with."""
ALGORITHMS = (BLAKE3, SHA256)

THREADS = 1
"""Threads one BLAKE3 hash may use. One: the hash runs beside the user's loop (an async
save's writer, tier 0's digest) and must not take the loop's core; several files are hashed
by several threads of ours already (the writer's, the verification's). Measured in
docs/checkpoint-modes.md."""


def hasher(algorithm: str = CURRENT):
    """A fresh hash object (`update`, `hexdigest`); both release the GIL for large inputs."""
    if algorithm == BLAKE3:
        return blake3.blake3(max_threads=THREADS)
    if algorithm == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown digest {algorithm!r}")


def entry(size: int, algorithm: str, value: str) -> dict:
    """One file's manifest entry."""
    return {"bytes": size, algorithm: value}


def algorithm_of(recorded: Mapping) -> str:
    """The algorithm a file's entry was digested with (its key)."""
    for name in ALGORITHMS:
        if name in recorded:
            return name
    raise ValueError("an entry without a digest")


def value_of(recorded: Mapping) -> str:
    """The hex digest of a file's entry, whatever its algorithm."""
    return recorded[algorithm_of(recorded)]


def of_bytes(data, algorithm: str = CURRENT) -> dict:
    """The entry of `data` held in memory."""
    digest = hasher(algorithm)
    digest.update(data)
    return entry(len(data), algorithm, digest.hexdigest())
