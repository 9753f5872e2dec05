"""Option value types for argparse, shared by the command line and by workloads declaring
their own options (`from trainer.options import positive_int`): a bad value is one line and
exit 2, like every other usage mistake."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from trainer.errors import UsageError
from trainer.location import OnDisk, InStore, is_url, parse_location


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def location_argument(text: str) -> OnDisk | InStore:
    """A run directory, parsed once: a local path (`OnDisk`), or a store URL with its default
    local tier (`InStore`)."""
    text_stripped = text.strip()
    if re.match(r"^(s3|gs|gcs|az|abfs):/[^/]", text_stripped):  # a URL with one slash: a local path by accident
        raise argparse.ArgumentTypeError(f"{text_stripped!r} looks like a store URL missing a slash; write "
                                         f"{text_stripped.replace(':/', '://', 1)}")
    if not is_url(text_stripped):
        path_argument(text)  # refuses an empty path
        return OnDisk(Path(text))
    try:
        return parse_location(text_stripped)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix(f"--output {text_stripped}: ")) from None


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


AUTO = "auto"


def positive_float_or_auto(text: str) -> float | str:
    """Seconds, or `auto` (the interval is derived from measurements)."""
    return AUTO if text.strip().lower() == AUTO else positive_float(text)


def positive_int_or_auto(text: str) -> int | str:
    """A count, or `auto` (derived from measurements)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {text}") from None


def unit_interval(text: str) -> float:
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def path_argument(text: str) -> Path:
    """A path that is not empty: `--output "$UNSET"` must not mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (an unset variable?); give a path")
    return Path(text)


def _number(text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a valid {kind.__name__}: {text!r}") from None
