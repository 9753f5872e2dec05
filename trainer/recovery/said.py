"""What a run says when the script configured no logging: the restore line and the warnings.

The trainer's lines go to the `trainer` logger. `python -m trainer` configures logging itself;
a user's script may not, and Python then prints warnings only, so a resumed run would not say
what it restored. While a run is open and neither the root logger nor `trainer` has a handler,
one handler prints to stderr the restore line (`ANNOUNCED`) and every warning and error: rank 0
as is, other ranks their warnings prefixed with their rank, as the command line does. A script
that configured logging sees every line its own way instead.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator


@contextlib.contextmanager
def announced(rank: int) -> Iterator[None]:
    from trainer.run.restoring import ANNOUNCED  # the restore's machinery: imported as a run opens

    logger = logging.getLogger("trainer")
    if logging.getLogger().handlers or logger.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"rank {rank}: %(message)s"))
    handler.addFilter(lambda record: record.levelno >= logging.WARNING or
                      (rank == 0 and all(getattr(record, key, None) == value for key, value in ANNOUNCED.items())))
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
