"""A cheap fingerprint for a large data file (a multi-GB token file), for a dataset's
`fingerprint()`: hashing the whole file at every start costs seconds per GB, every attempt.

`file_fingerprint(path)` hashes the size and `SAMPLES` evenly spaced windows of `WINDOW`
bytes (the first and last included): a fixed read (4 MiB) whatever the size. It notices a
truncated, extended, replaced or re-tokenised file; an edit confined to bytes between the
windows goes unnoticed. When the producer stored a full digest beside the file
(`<file>.sha256`, as `sha256sum` writes it), that digest is used instead: exact and free.
The modification time is left out on purpose: copying the data to another node changes it,
and the resume would be refused for nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLES = 64
WINDOW = 64 * 1024


def file_fingerprint(path: str | Path, samples: int = SAMPLES, window: int = WINDOW) -> str:
    path = Path(path)
    stored = path.with_name(path.name + ".sha256")
    if stored.is_file():
        return "sha256:" + stored.read_text().split()[0]
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}:{samples}:{window}".encode())
    with path.open("rb") as handle:
        for offset in window_offsets(size, samples, window):
            handle.seek(offset)
            digest.update(handle.read(window))
    return f"sampled:{size}:{digest.hexdigest()}"


def window_offsets(size: int, samples: int, window: int) -> list[int]:
    """Where the windows start: evenly spaced from the first byte to the last window."""
    if size <= samples * window:
        return list(range(0, size, window))
    last = size - window
    return [last * i // (samples - 1) for i in range(samples)]
