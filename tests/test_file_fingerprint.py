"""The cheap fingerprint for large data files (trainer/workload/files.py): what it notices,
what it reads, and a stored digest winning. Pure file I/O, under a second."""

from __future__ import annotations

import os

from trainer.workload.files import WINDOW, file_fingerprint, window_offsets


def test_a_sampled_fingerprint_notices_size_and_sampled_changes_and_ignores_mtime(tmp_path):
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(os.urandom(4 * 1024 * 1024))
    first = file_fingerprint(tokens)
    assert first.startswith("sampled:4194304:")
    os.utime(tokens, (1, 1))  # copied to another node: same content, new mtime
    assert file_fingerprint(tokens) == first
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 1  # the last window is always read
    tokens.write_bytes(bytes(data))
    assert file_fingerprint(tokens) != first
    tokens.write_bytes(bytes(data) + b"x")
    assert file_fingerprint(tokens) != first


def test_the_read_is_fixed_whatever_the_size_and_a_stored_digest_wins(tmp_path):
    offsets = window_offsets(10 * 1024 ** 3, 64, WINDOW)
    assert len(offsets) == 64 and offsets[0] == 0 and offsets[-1] == 10 * 1024 ** 3 - WINDOW
    assert window_offsets(3 * WINDOW, 64, WINDOW) == [0, WINDOW, 2 * WINDOW]  # small: every byte
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"abc")
    (tmp_path / "tokens.bin.sha256").write_text("deadbeef  tokens.bin\n")
    assert file_fingerprint(tokens) == "sha256:deadbeef"
