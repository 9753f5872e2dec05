"""The command line is derived from the configuration: one source for every default, shown in
`--help`; help for every option; abbreviated options refused. In process (no subprocess)."""

from __future__ import annotations

import dataclasses

import pytest

from trainer.cli import config_from_args, train_parser, workload_parser
from trainer.config import DEFAULT_WORKLOAD, RunConfig
from trainer.errors import UsageError
from trainer.flags import ALL_FLAGS, default_of


def test_every_flag_defaults_to_its_config_field_and_the_parsed_defaults_are_the_config_defaults():
    parser, declared = workload_parser(DEFAULT_WORKLOAD)
    args = parser.parse_args(["--output", "run"])
    for flag in ALL_FLAGS:
        assert parser.get_default(flag.dest) == flag.default(), flag.flag
    config = config_from_args(args, [], args.output, declared)
    expected = dataclasses.replace(RunConfig(location=args.output), workload=dataclasses.replace(
        RunConfig(location=None).workload, options=config.workload.options))
    assert config == expected  # nothing the command line did not say differs from the dataclasses


def test_a_flag_sets_the_field_it_names():
    parser, declared = workload_parser(DEFAULT_WORKLOAD)
    args = parser.parse_args(["--output", "run", "--epochs", "3", "--keep-last", "5", "--recover-every-epochs", "0",
                              "--store-retries", "7", "--preempt-grace-secs", "9", "--log-every-secs", "2"])
    config = config_from_args(args, [], args.output, declared)
    assert (config.workload.epochs, config.retention.keep_last, config.recover.every_epochs) == (3, 5, None)
    assert (config.store_config.retries, config.preempt_grace_s, config.progress.every_s) == (7, 9.0, 2.0)
    assert default_of("workload.epochs") == 8 and default_of("recover.every_epochs") == 1


def test_help_shows_every_default_and_every_option_has_help():
    parser = train_parser()
    text = parser.format_help()
    for shown in ("--epochs N", "(default: 8)", "--seed N", "(default: 1234)", "--num-workers N", "(default: 0)",
                  "--preempt-grace-secs S", "(default: 20.0)", "--keep-last K", "(default: 3)",
                  "--recover-every-epochs N", "list|verify|report", "--hidden-size N"):
        assert shown in text, shown
    undocumented = [action.option_strings for action in parser._actions if action.option_strings
                    and not action.help]
    assert not undocumented, undocumented


@pytest.mark.parametrize("abbreviated", ["--epoch", "--keep-las", "--batch"])
def test_an_abbreviated_option_is_a_usage_error(abbreviated):
    """Each is a prefix of one option, which argparse would take by default."""
    with pytest.raises(UsageError) as refused:
        train_parser().parse_args(["--output", "run", abbreviated, "3"])
    assert f"unrecognized arguments: {abbreviated} 3" in str(refused.value)
