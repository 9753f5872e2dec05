"""What a run leaves behind (generations, attempt records, report PNGs), and the reference runs
every worker shares (`baseline`, `short_baseline`, `baseline_2p`, `matrix_baseline`, made once
per session by `made_once`)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from support.cli import train
from support.torchrun import trainer_ranks

FINAL = "step-00000064"
SHORT = ("--epochs", 3)
"""A 24-step run (3 epochs of the default workload): what `short_baseline` trains."""
SHORT_FINAL = "step-00000024"
TWO_PROCESS_EPOCHS = 2
"""16 steps on two processes: what `baseline_2p` trains."""
FINAL_2P = "step-00000016"
MATRIX_ARGS = ("--samples", 144, "--batch-size", 12, "--epochs", 1, "--recover-every-steps", 4, "--keep-last", 10)
"""12 steps; the batch splits evenly over 2, 3 and 4 ranks (test_exact_matrix.py's cells)."""


def generation(output: Path, name: str = FINAL) -> Path:
    return output / "checkpoints" / name


def attempts(output: Path) -> list[dict]:
    folders = sorted((output / "attempts").iterdir())
    return [json.loads((f / "attempt.json").read_text()) for f in folders]


def png_size(path) -> tuple[int, int]:
    """Width and height from the PNG header (signature, then the IHDR chunk)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A folder `make(folder)` fills once per pytest session, shared by every xdist worker: the
    first worker that asks makes it under a file lock, the others wait for it and reuse it (a
    reference run costs every worker's CPU otherwise). Tests only read it or copy it."""
    from filelock import FileLock  # a dependency of torch

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's folder
    folder = root / f"shared-{name}"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> Path:
    """An uninterrupted default run, shared by every test that compares against it."""
    return made_once(tmp_path_factory, "baseline", lambda folder: train(folder / "run")) / "run"


@pytest.fixture(scope="session")
def short_baseline(tmp_path_factory) -> Path:
    """An uninterrupted 3-epoch local run (`SHORT`), shared by every short local and store run
    that must end equal to it."""
    return made_once(tmp_path_factory, "short-baseline", lambda folder: train(folder / "run", *SHORT)) / "run"


@pytest.fixture(scope="session")
def baseline_2p(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run (one disk; ranks forked as a launcher starts them,
    `trainer_ranks`: the bits of a torchrun run), the reference for every 2-process resume:
    test_scale_out.py's, test_peer_failures.py's, and two nodes on one store in
    test_store_pods.py (where the ranks run and store is no input)."""
    return made_once(tmp_path_factory, "baseline-2p", lambda root: trainer_ranks(
        root / "run", "--epochs", TWO_PROCESS_EPOCHS, nproc=2)) / "run"


def matrix_baseline(tmp_path_factory, world_size: int, parallel: str) -> Path:
    """The uninterrupted `MATRIX_ARGS` run on `world_size` processes (sync saves), made once per
    session: test_exact_matrix.py's cell baselines, and test_store_pods.py's ring of three nodes
    ends equal to the 3-process DDP one. Its ranks are forked (`trainer_ranks`)."""
    return made_once(tmp_path_factory, f"matrix-{world_size}-{parallel}", lambda root: trainer_ranks(
        root / "run", *MATRIX_ARGS, "--data-parallel", parallel, "--checkpoint-mode", "sync",
        nproc=world_size)) / "run"
