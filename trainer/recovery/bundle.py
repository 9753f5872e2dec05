"""Your own script run by the Polyaxon bundle (docs/library.md "Polyaxon").

`polyaxonfiles/polyaxonfile.yaml` with the input `script` runs
`python -m trainer.recovery --script FILE [--script-args ARGS] --tracked OPTIONS...`, the same
options it gives `python -m trainer`. The launcher (`__main__.py`) puts the options in
`TRAINER_RECOVERY_ARGS` and runs the script; the script's `open_run` then takes from them what
the command line would: the run directory (the tracked run's placement: its store, `--copy`
seeding, statuses and metrics) and every option the bundle sets, over the script's own.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import replace

from trainer.cli import check_option_combinations, config_from_args, tracked_placement, trainer_parser
from trainer.config import RunConfig
from trainer.flags import ALL_FLAGS, AUTO_BOUNDS
from trainer.parallel.launch import LaunchEnvironment
from trainer.location import OnDisk

BUNDLE_ENV = "TRAINER_RECOVERY_ARGS"
"""The trainer's options for a script the bundle runs (set by `python -m trainer.recovery`)."""


def bundle_options() -> list[str] | None:
    """The bundle's options, when a bundle runs this script (None: the script decides alone)."""
    text = os.environ.get(BUNDLE_ENV)
    return None if text is None else shlex.split(text)


def bundled(script: RunConfig, argv: list[str]):
    """(the run's configuration, its observer or None): the script's own configuration with
    the bundle's run directory and every option the bundle gave on top."""
    launch = LaunchEnvironment.from_environ(os.environ)
    args = trainer_parser().parse_args(argv)
    check_option_combinations(args, launch)
    events, placement = None, None
    location = args.output
    if args.tracked:
        from trainer.integrations.polyaxon.tracking import PolyaxonEvents  # imports polyaxon: only when tracked

        events = PolyaxonEvents.start()
        placement = tracked_placement(args, launch, events.run_uuid)
        events.place(placement)
        location = placement.location or OnDisk(events.outputs_path)
    given = config_from_args(args, argv, location, ())
    config = replace(script, location=given.location, argv=script.argv + tuple(argv), signing=given.signing)
    for flag in ALL_FLAGS:
        if flag.path.rpartition(".")[0] not in AUTO_BOUNDS and given_on(argv, flag.flag):
            config = with_field(config, flag.path, field_value(given, flag.path))
    if given.recover.auto is not None:
        config = replace(config, recover=replace(config.recover, auto=given.recover.auto))
    if given_on(argv, "--memory-every-steps"):  # N or auto, as given
        config = replace(config, memory=replace(config.memory, auto=given.memory.auto))
    if events is not None:
        events.seed_if_copy(placement, config.store_config)  # `ops restart --copy`
    return config, events


def given_on(argv: list[str], option: str) -> bool:
    return any(arg == option or arg.startswith(option + "=") for arg in argv)


def field_value(config: RunConfig, path: str):
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def with_field(config: RunConfig, path: str, value) -> RunConfig:
    section, _, name = path.rpartition(".")
    if not section:
        return replace(config, **{name: value})
    return replace(config, **{section: replace(getattr(config, section), **{name: value})})
