"""What a run says when the script configured no logging: the restore line and the warnings.

The trainer's lines go to the `trainer` logger. `python -m trainer` configures logging itself;
a user's script may not, and Python then prints warnings only, so a resumed run would not say
what it restored. While a run is open and neither the root logger nor `trainer` has a handler,
one handler prints to stderr the restore line (`ANNOUNCED`) and every warning and error: rank 0
as is, other ranks their warnings prefixed with their rank, as the command line does. A script
that configured logging sees every line its own way instead.

A line that names an option names it as the library spells it (`spelled`): `resume='auto'`,
not `--resume auto`; the message is the command line's, one text for both.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from dataclasses import fields
from typing import Iterator

from trainer.data.keyed import KeyedData
from trainer.errors import OPTION
from trainer.flags import ALL_FLAGS, Flag, keyword_of
from trainer.location import LOCAL_TIER_ENV

RUN_DIRECTORY = "run directory (open_run's first argument)"
"""What a line calls `--output` (not one of the flags: open_run takes it first)."""
LOCAL_TIER = f"local tier (set the {LOCAL_TIER_ENV} environment variable to the folder that holds them)"
"""What a line calls `--local-tier` (not one of `open_run`'s options: the default local tier of a
store URL lies under that folder)."""
KEYED_SETTINGS = frozenset(item.name for item in fields(KeyedData))
"""The data's settings: given to `KeyedData`, not to `open_run`."""


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


def spelled(error: BaseException | str) -> str:
    """`error`'s message with the options it names (`trainer.errors.option`) as keywords:
    `open_run`'s (`allow_drift=('world_size',)`), or `KeyedData`'s for the data's settings
    (`KeyedData(batch_size=10)`). Every flag's keyword comes from its field (trainer/flags.py)."""
    text = error if isinstance(error, str) else Exception.__str__(error)
    return re.sub(f"{ONE}(?: {ONE})*", lambda found: keywords(found[0]), text)


ONE = f"{OPTION}--[a-z-]+(?: [^{OPTION}]*)?{OPTION}"
"""One option named in a message (`trainer.errors.option`); a run of them, space-separated, is
one mention (`--allow-drift os --allow-drift world_size` is `allow_drift=('os', 'world_size')`)."""


def keywords(mention: str) -> str:
    """A run of options as the library spells them: a repeatable flag's values in one tuple."""
    named: dict[str, list[str | None]] = {}
    for found in re.finditer(f"{OPTION}(--[a-z-]+)(?: ([^{OPTION}]*))?{OPTION}", mention):
        named.setdefault(found[1], []).append(found[2])
    return " ".join(keyword(name, values) for name, values in named.items())


def keyword(name: str, texts: list[str | None]) -> str:
    """`--name text` (repeated for each of `texts`) as the library spells it."""
    if name == "--workload":  # a dataset's mistake: named by what the library calls it (KeyedData)
        return texts[-1] or "your own loop"
    flag = next((flag for flag in ALL_FLAGS if flag.flag == name), None)
    if flag is None:
        if name == "--output":
            return RUN_DIRECTORY if texts[-1] is None else f"run directory {texts[-1]}"
        if name == "--local-tier":
            return LOCAL_TIER if texts[-1] is None else f"local tier {texts[-1]}"
        return " ".join(f"{name} {text}".strip() for text in texts)
    if flag.options.get("action") == "append":
        value = tuple(typed(flag, text) for text in texts if text is not None) or None
    else:
        value = None if texts[-1] is None else typed(flag, texts[-1])
    section, _, field = flag.path.rpartition(".")
    if section == "workload" and field in KEYED_SETTINGS:
        return f"KeyedData({field}={value!r})"
    return keyword_of(flag, value)


def typed(flag: Flag, text: str):
    """`text` as the flag's field holds it (`10`, not `'10'`)."""
    try:
        return flag.type(text) if flag.type is not None else text
    except Exception:  # noqa: BLE001 - a value the command line would refuse: named as written
        return text
