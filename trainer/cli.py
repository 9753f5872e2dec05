"""Command line: parse options into frozen config, run, and map typed errors to exit codes.

This is the only module that prints errors or chooses exit statuses. Every failure a user
or operator can cause ends as one line on stderr and a sysexits-style status, never a
traceback. Under torchrun, rank 0 prints `trainer: error: ...`; another rank prints its own
failure as `trainer: rank N: error: ...` and stays silent about an error rank 0 already
reported for every rank. Ranks other than 0 log only warnings, prefixed with their rank.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import gc
import json
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import NoReturn

from trainer import compat, seams
from trainer.config import DEFAULT_WORKLOAD, AutoCadenceConfig, RunConfig, SigningConfig, StoreConfig, WorkloadConfig
from trainer.checkpoint.signing import KEY_FILE_ENV, load_signing
from trainer.flags import (STORE_GROUP, ShowDefaults, add_flags, changed_memory_flags, changed_store_flags,
                           config_from_values, default_of, given_settings)
from trainer.errors import EXIT_INTERRUPTED, TrainerError, UsageError, storage_failure
from trainer.location import ClaimedByPrimary, OnDisk, Location
from trainer.run.fingerprint import FIELDS
from trainer.parallel.launch import LaunchEnvironment, is_multi_process, local_rank_of, rank_of
from trainer.parallel.cuda_fork import WORKLOAD, CudaQueries, CudaState, fork_refusal
from trainer.parallel.spare import from_spare, restarts_possible, start_spare
from trainer.options import AUTO, location_argument, path_argument, positive_float

EXIT_STATUS_ENV = "TRAINER_EXIT_STATUS_FILE"
PROGRAM = "python -m trainer"
"""How usage and `--help` name the command unless the console script says its own name."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit 2, and an abbreviated
    option is a mistake (`--resum` must not run as `--resume`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    help_command: str | None = None
    """What lists every option (a workload's own appear only with `--workload X --help`)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.help_command or self.prog + ' --help'})")


def train_parser(workload: str = DEFAULT_WORKLOAD) -> OneLineParser:
    """Every option of a training run, the chosen workload's own included (so `--help`
    lists them)."""
    return workload_parser(workload)[0]


def workload_parser(workload: str, program: str = PROGRAM) -> tuple[OneLineParser, tuple[str, ...]]:
    """The training parser with `workload`'s options, and their names."""
    from trainer.workload.loading import find_factory  # imports the workload (and torch)

    parser = trainer_parser(program)
    trainer_names = set(vars(parser.parse_known_args([])[0]))
    found = find_factory(workload)
    declared = found.add_options(parser.add_argument_group(f"options of the workload {workload}"))
    if workload != DEFAULT_WORKLOAD:
        parser.help_command = f"{parser.prog} --workload {workload} --help"
    if clashes := sorted(set(declared) & trainer_names):
        raise found.clash(clashes)
    return parser, tuple(declared)


def chosen_workload(argv: list[str]) -> str:
    """Phase one of parsing: only `--workload`, so its options can join the parser."""
    finder = OneLineParser(add_help=False)
    finder.add_argument("--workload", default=DEFAULT_WORKLOAD)
    return finder.parse_known_args(argv)[0].workload


def trainer_parser(program: str = PROGRAM) -> OneLineParser:
    """`program`: what the user ran (`training-recovery`, or `python -m trainer`)."""
    parser = OneLineParser(prog=program, formatter_class=ShowDefaults,
                           usage=f"{program} --output DIR|URL [options]\n"
                                 f"       {program} list|verify|report DIR|URL [--json] (see COMMAND --help)\n"
                                 f"       {program} compare GENERATION GENERATION [--json]",
                           description="Train with exact, crash-safe recovery. Other commands: `list DIR|URL`, "
                                       "`report DIR|URL`, `verify DIR|GEN|URL`, `compare A B`.")
    parser.add_argument("--output", type=location_argument, metavar="DIR|URL",
                        help="run directory (generations, exports, attempt records): a local path, or an object "
                             "store URL s3://BUCKET/PREFIX (gs://, az://) to make every generation durable there")
    parser.add_argument("--tracked", action="store_true",
                        help="track with Polyaxon (in a Polyaxon job, or anywhere with POLYAXON_IS_OFFLINE=true); "
                             "the run directory is the run's outputs in its artifacts store when the container "
                             "reaches the store (mountArtifactsStore), else its outputs path; replaces --output")
    groups = add_flags(parser, FIELDS)
    add_signing_options(groups["recovery"], adopt=True)
    add_auto_cadence_options(groups["cadence (any trigger that is set fires)"])
    groups[STORE_GROUP].add_argument(
        "--local-tier", type=path_argument, metavar="DIR",
        help="this machine's working copy of the run (default: $TRAINER_LOCAL_TIER, else "
             "TMPDIR/training-recovery/SCHEME/BUCKET/PREFIX, TMPDIR being the system's temporary folder; "
             "under --tracked $TRAINER_LOCAL_TIER/RUN_UUID)")
    return parser


def add_signing_options(group, adopt: bool = False) -> None:
    what = ("sign every manifest written and refuse (65) generations not signed with this key" if adopt else
            "check each manifest's signature with this key: one not signed with it is not trusted (65)")
    group.add_argument("--signing-key-file", type=path_argument, default=SigningConfig.key_file, metavar="FILE",
                       help=f"{what} (HMAC-SHA256; the file holds the key, e.g. a mounted Secret; default: the file "
                            f"${KEY_FILE_ENV} names, else {'no signing' if adopt else 'no signature check'})")
    if adopt:
        group.add_argument("--allow-unsigned", action="store_true", default=SigningConfig.allow_unsigned,
                           help="with a signing key: also restore unsigned generations (a run that started "
                                "before signing); recorded in the attempt")


def add_auto_cadence_options(group) -> None:
    """The bounds of `--recover-every-secs auto`: one AutoCadenceConfig from three options."""
    group.add_argument("--recover-auto-min-secs", type=positive_float, default=default_of("recover.auto.min_s"),
                       metavar="S", help="with auto: shortest interval, and the first one until a save cost is known")
    group.add_argument("--recover-auto-max-secs", type=positive_float, default=default_of("recover.auto.max_s"),
                       metavar="S", help="with auto: longest interval")
    add_assume_mtbf_option(group, "with auto: mean time between failures to plan with while the run has seen "
                                  "fewer than 3 (e.g. the cluster's; default: the run's own history)")


def add_assume_mtbf_option(group, text: str) -> None:
    """`--assume-mtbf-secs`, the M to plan with while a run has seen few failures: training's
    auto cadence and the report's advice read it alike."""
    group.add_argument("--assume-mtbf-secs", type=positive_float, default=AutoCadenceConfig.assume_mtbf_s,
                       metavar="S", help=text)


def check_auto_cadence(args: argparse.Namespace) -> None:
    check_auto_options("--recover-every-secs", args.recover_every_secs == AUTO,
                       {"--recover-auto-min-secs": (args.recover_auto_min_secs, default_of("recover.auto.min_s")),
                        "--recover-auto-max-secs": (args.recover_auto_max_secs, default_of("recover.auto.max_s")),
                        "--assume-mtbf-secs": (args.assume_mtbf_secs, AutoCadenceConfig.assume_mtbf_s)})


def check_auto_options(trigger: str, auto: bool, options: dict[str, tuple]) -> None:
    """Both auto cadences alike: their options (`options`: {option: (value given, its
    default)}, the minimum and the maximum first) apply only with `trigger auto`, and the
    minimum is not above the maximum."""
    if not auto and (given := [name for name, (value, default) in options.items() if value != default]):
        raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with {trigger} auto; "
                         f"add it, or drop {'it' if len(given) == 1 else 'them'}")
    (low_option, (low, _)), (high_option, (high, _)) = list(options.items())[:2]
    if low > high:
        raise UsageError(f"{low_option} {low:g} is above {high_option} {high:g}; make the minimum the smaller")


def auto_cadence(trigger: object, low: float, high: float, assume_mtbf_s: float | None) -> AutoCadenceConfig | None:
    """Either auto cadence's configuration (None: its `trigger` option is not auto): its bounds,
    and the M to plan with (`--assume-mtbf-secs`, given only with `--recover-every-secs auto`)."""
    return AutoCadenceConfig(low, high, assume_mtbf_s) if trigger == AUTO else None


def signing_config(args: argparse.Namespace) -> SigningConfig:
    """The key file from the option, else from the environment; never the key itself."""
    key_file = args.signing_key_file
    if key_file is None and os.environ.get(KEY_FILE_ENV):
        key_file = Path(os.environ[KEY_FILE_ENV])
    return SigningConfig(key_file, getattr(args, "allow_unsigned", SigningConfig.allow_unsigned))


def check_memory_tier(args: argparse.Namespace) -> None:
    """The tier-0 options mean nothing without its directory."""
    if args.memory_dir is None and (given := changed_memory_flags(args)):
        raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with --memory-dir; "
                         f"add it (e.g. --memory-dir /dev/shm/RUN), or drop {'it' if len(given) == 1 else 'them'}")
    check_auto_options("--memory-every-steps", args.memory_every_steps == AUTO,
                       {"--memory-auto-min-secs": (args.memory_auto_min_secs, default_of("memory.auto.min_s")),
                        "--memory-auto-max-secs": (args.memory_auto_max_secs, default_of("memory.auto.max_s"))})


def check_option_combinations(args: argparse.Namespace, launch: LaunchEnvironment) -> None:
    """Cheap checks that need no import, done before tracking or torch start."""
    if args.data_parallel == "fsdp" and args.gradient_reduction != WorkloadConfig.gradient_reduction:
        raise UsageError(f"--gradient-reduction {args.gradient_reduction} chooses how DDP all-reduces gradients; "
                         f"--data-parallel fsdp reduce-scatters them instead (exact as it is): drop "
                         f"--gradient-reduction")
    if args.data_parallel == "fsdp" and launch.world_size == 1:
        raise UsageError("--data-parallel fsdp shards the model across processes and needs torchrun with "
                         "--nproc_per_node 2 or more; drop it for a single-process run")
    if args.tracked and args.output is not None:
        raise UsageError("--output and --tracked are exclusive: with --tracked the run directory is "
                         "the Polyaxon run's (in its artifacts store, or its outputs path); drop --output")
    if not args.tracked and args.output is None:
        raise UsageError("--output DIR is required (the run directory); e.g. --output outputs/run1, "
                         "or --tracked to use Polyaxon's outputs path")
    check_memory_tier(args)
    if not args.tracked:  # tracked: known once the run's artifacts store is (tracked_placement)
        require_store_for_store_options(args, args.output.in_store)
    if args.lease_ttl_secs < 1:
        raise UsageError(f"--lease-ttl-secs {args.lease_ttl_secs:g} is too short to renew over a network; "
                         f"use 1 or more (default {StoreConfig.lease_ttl_s:g})")
    if args.resume is not None and args.from_generation is not None:
        raise UsageError("--resume and --from-generation are exclusive; --from-generation already resumes")
    if args.tracked and (args.resume == "latest" or args.from_generation is not None):
        require_offline_run_to_continue(os.environ, "--resume" if args.from_generation is None else "--from-generation")
    check_auto_cadence(args)


def require_offline_run_to_continue(environ, option: str) -> None:
    """Offline, a process without POLYAXON_RUN_INSTANCE is a new, empty run: refuse before it is made."""
    offline = environ.get("POLYAXON_IS_OFFLINE", "").lower() in ("true", "1")
    if offline and not environ.get("POLYAXON_RUN_INSTANCE"):
        raise UsageError(f"{option} with offline tracking continues an existing offline run: set "
                         f"POLYAXON_RUN_INSTANCE=owner.project.runs.UUID (its folder is $POLYAXON_OFFLINE_ROOT/runs/"
                         f"UUID); without it every process is a new, empty run")


def require_store_for_store_options(args: argparse.Namespace, in_store: bool) -> None:
    store_options = changed_store_flags(args) + (["--local-tier"] if args.local_tier is not None else [])
    if store_options and not in_store:
        where = ("the run's artifacts store is not a bucket exposed to the container (polyaxonfile plugin "
                 "mountArtifactsStore)" if args.tracked else "pass --output s3://BUCKET/PREFIX")
        one = len(store_options) == 1
        raise UsageError(f"{', '.join(store_options)} {'applies' if one else 'apply'} only to a run directory in "
                         f"a store; {where}, or drop {'it' if one else 'them'}")


def config_from_args(args: argparse.Namespace, argv: list[str], location: Location,
                     workload_options: tuple[str, ...]) -> RunConfig:
    config = config_from_values(args, tuple((name, getattr(args, name)) for name in workload_options),
                                location=location.with_local_tier(args.local_tier),  # beats the default tier
                                 signing=signing_config(args), argv=tuple(argv))
    mtbf_s = args.assume_mtbf_secs
    recover_auto = auto_cadence(args.recover_every_secs, args.recover_auto_min_secs, args.recover_auto_max_secs, mtbf_s)
    memory_auto = auto_cadence(args.memory_every_steps, args.memory_auto_min_secs, args.memory_auto_max_secs, mtbf_s)
    return replace(config, recover=replace(config.recover, auto=recover_auto),
                   memory=replace(config.memory, auto=memory_auto),
                   workload=replace(config.workload, given=getattr(args, "given_settings", frozenset())))


def run_train(argv: list[str], program: str = PROGRAM) -> int:
    gc.disable()  # until the start-up's imports are done: see collect_after_start_up
    launch = LaunchEnvironment.from_environ(os.environ)
    cuda_queries = CudaQueries().watch()  # before the workload is imported: what it asks of CUDA poisons a fork
    try:
        parser, workload_options = workload_parser(chosen_workload(argv), program)
        args = parser.parse_args(argv)
        args.given_settings = given_settings(parser, argv)  # a DataLoader from build_dataset fills the others
        check_option_combinations(args, launch)
        load_signing(signing_config(args))  # a missing or unusable key file: one line now, before any work
        seams.install(seams.Seams.from_environment(os.environ, launch.rank))
        import_for_training(args.warm_spare, launch, cuda_queries)
    finally:
        cuda_queries.stop()
    if not args.tracked:
        return train_in(config_from_args(args, argv, args.output, workload_options), launch)
    if launch.rank != 0:
        # Under torchrun only rank 0 talks to Polyaxon. Every rank finds the run's store itself
        # (pods share no filesystem); without one, the others learn rank 0's outputs path.
        placement = tracked_placement(args, launch)
        return train_in(config_from_args(args, argv, placement.location or ClaimedByPrimary(), workload_options),
                        launch)
    from trainer.integrations.polyaxon.tracking import PolyaxonEvents  # imports polyaxon: only with --tracked

    events = PolyaxonEvents.start()

    def train_tracked(outputs: Path) -> int:
        placement = tracked_placement(args, launch, events.run_uuid)
        events.place(placement)
        config = config_from_args(args, argv, placement.location or OnDisk(outputs), workload_options)
        events.seed_if_copy(placement, config.store_config)  # `ops restart --copy` (copy_seed.py)
        return train_in(config, launch, events)

    return events.track(train_tracked)


def tracked_placement(args: argparse.Namespace, launch: LaunchEnvironment, own_run_uuid: str | None = None):
    """The tracked run's directory (trainer/integrations/polyaxon/placement.py), with the store's client
    variables exported and the store options checked against it."""
    from trainer.integrations.polyaxon.placement import place_run  # reads Polyaxon's connection schema

    placement = place_run(os.environ, own_run_uuid, launch.world_size, args.local_tier)
    require_store_for_store_options(args, placement.in_store)
    for name, value in placement.environment.items():  # only variables that were not set
        os.environ.setdefault(name, value)
    if placement.warning and launch.rank == 0:
        logging.getLogger("trainer").warning("tracking: %s", placement.warning)
    return placement


def collect_after_start_up() -> None:
    """Importing torch and DCP makes millions of long-lived objects and almost no garbage; the
    cyclic collector would spend about a sixth of the start-up's CPU scanning them (a restart's
    cost R, and every process of a torchrun). Frozen, they are never scanned again."""
    gc.freeze()
    gc.enable()


def import_for_training(warm_spare: bool, launch: LaunchEnvironment, cuda_queries: CudaQueries) -> None:
    """The start-up's imports, after cheap validation; the collector frozen over them; then,
    before tracking or training starts a thread, the warm spare forked (under torchrun with
    restarts: the node's first worker, trainer/parallel/spare.py), unless anything queried CUDA
    (`cuda_queries`, watching since before the workload was imported: trainer/parallel/cuda_fork.py)."""
    import trainer.run.loop  # noqa: F401  (imports torch)
    import torch.distributed.checkpoint  # noqa: F401  (every run saves through DCP: imported before the freeze)
    import torch._dynamo  # noqa: F401  (torch.optim imports it at its first load_state_dict or step: before the freeze)

    collect_after_start_up()
    cuda_queries.stop()
    if warm_spare:
        fork_warm_spare(launch, cuda_queries, "--no-warm-spare")


def fork_warm_spare(launch: LaunchEnvironment, cuda_queries: CudaQueries, opt_out: str,
                    during: tuple[str, str] = WORKLOAD) -> int | None:
    """The node's first worker of a launch that may restart (`restarts_possible`) forks the warm
    spare once its imports are done, unless anything it imported queried CUDA (`fork_refusal`:
    then its restarts start cold, said in one log line). The spare's pid, or None. `opt_out`:
    how a user runs without it (said in the line); `during`: what was imported (`fork_refusal`)."""
    if not (launch.local_rank == 0 and restarts_possible(os.environ) and not from_spare(os.environ)):
        return None
    log = logging.getLogger("trainer")
    if refusal := fork_refusal(CudaState.of_this_process(cuda_queries), during):
        log.info("warm spare: none, this node's restarted workers start cold: %s", refusal)
        return None
    if (pid := start_spare(os.environ)) is not None:
        log.info("warm spare: pid %d keeps the imports for this node's restarted workers (%s: none)", pid, opt_out)
    return pid


def train_in(config: RunConfig, launch: LaunchEnvironment, events=None) -> int:
    from trainer.run.events import TrainingEvents
    from trainer.run.loop import run_training

    events = events or TrainingEvents()
    outcome = run_training(config, launch, events)
    if outcome.status == EXIT_INTERRUPTED and launch.is_primary:
        # Resumable, not an error; one line on stderr all the same, where operators look.
        print(f"trainer: stopped, resumable (exit 75): {outcome.reason}; to continue, {events.continue_hint()}",
              file=sys.stderr, flush=True)
    return outcome.status


RUN_OR_URL = "a run directory, or the store URL of one (s3://BUCKET/RUN)"


def run_list(argv: list[str], program: str = PROGRAM) -> int:
    parser = OneLineParser(prog=f"{program} list",
                           description="Generations, exports and attempts; for a run in a store, also which "
                                       "generations are durable and which this machine's local tier holds.")
    parser.add_argument("directory", type=location_argument, metavar="DIR|URL", help=RUN_OR_URL)
    parser.add_argument("--local-tier", type=path_argument, metavar="DIR",
                        help="with a URL: this machine's working copy of the run (default: the trainer's default "
                             "local tier of that URL)")
    parser.add_argument("--store", type=location_argument, metavar="URL",
                        help="with a DIR that is the local tier of a run in a store: list that run, DIR as its "
                             "local tier (the same as `list URL --local-tier DIR`)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    add_signing_options(parser)
    args = parser.parse_args(argv)
    signing = load_signing(signing_config(args))
    from trainer.inspect.listing import print_run, require_run_directory
    from trainer.inspect.sources import open_source

    return print_run(open_source(listed_location(args, require_run_directory), signing).describe(), args.json)


def listed_location(args: argparse.Namespace, require_run_directory) -> Location:
    """`list URL [--local-tier DIR]` or `list DIR --store URL`: one run in a store and its local
    tier; `list DIR`: a local run."""
    if args.directory.in_store and args.store is not None:
        raise UsageError("--store goes with a local run directory; with a URL, name the local tier with "
                         "--local-tier DIR")
    if not args.directory.in_store and args.local_tier is not None:
        raise UsageError("--local-tier goes with a store URL; for a local run directory that is the local tier "
                         "of a run in a store, add --store URL")
    if args.store is None:
        return args.directory.with_local_tier(args.local_tier)
    if not args.store.in_store:
        raise UsageError(f"--store takes a store URL (s3://BUCKET/RUN), not the path {args.store}")
    require_run_directory(args.directory.root)
    return args.store.with_local_tier(args.directory.root)


def run_verify(argv: list[str], program: str = PROGRAM) -> int:
    parser = OneLineParser(prog=f"{program} verify",
                           description="Apply every check --resume applies to generations and exports: each file "
                                       "re-hashed against its manifest, name, run, signature, and every stored "
                                       "value loaded without running code (docs/security.md).")
    parser.add_argument("path", type=location_argument, metavar="DIR|GEN|URL",
                        help="a run directory or one generation/export directory, or the store URL of either")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    add_signing_options(parser)
    args = parser.parse_args(argv)
    signing = load_signing(signing_config(args))
    from trainer.inspect.listing import print_verifications
    from trainer.inspect.sources import open_source

    return print_verifications(open_source(args.path, signing).verifications(), args.json)


def run_report(argv: list[str], program: str = PROGRAM) -> int:
    parser = OneLineParser(prog=f"{program} report",
                           description="Recovery report: per attempt, steps computed, replayed and lost and what "
                                       "restores and saves cost; goodput and time lost for the run.")
    parser.add_argument("directory", type=location_argument, metavar="DIR|URL", help=RUN_OR_URL)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--png", type=path_argument, metavar="FILE",
                        help="also draw the timeline of the attempts into FILE (PNG, 1600x900)")
    add_assume_mtbf_option(parser, "mean time between failures for the save-interval advice while the run has "
                                   "seen fewer than 3 (e.g. the cluster's known rate)")
    args = parser.parse_args(argv)
    from trainer.inspect.listing import print_report
    from trainer.inspect.sources import open_source

    source = open_source(args.directory)
    return print_report(source.report(), source.where, args.json, args.png, args.assume_mtbf_secs)


def run_compare(argv: list[str], program: str = PROGRAM, prog: str | None = None) -> int:
    """Exit 0 iff every field is bit-identical, 1 if any differs, 2 if an input is unreadable,
    65 if one holds a pickle that loading would have to run code for (never unpickled), 74 if
    a store cannot be reached or refuses our credentials, 75 if interrupted. `prog`: the whole
    command as usage names it (`python compare.py`), when not `PROGRAM compare`."""
    from trainer.errors import StorageFailure, UntrustedGeneration

    # Store retries are reported as they happen, on stdout as the trainer does; nothing at INFO.
    logging.getLogger().setLevel(logging.WARNING)
    parser = OneLineParser(prog=prog or f"{program} compare",
                           description="Prove two recovery generations hold the same training state: every field "
                                       "bit for bit, and the samples each trained on.")
    parser.add_argument("a", type=location_argument,
                        help="baseline generation, e.g. outputs/baseline/checkpoints/step-00000064, or its store "
                             "URL s3://BUCKET/RUN/checkpoints/step-00000064")
    parser.add_argument("b", type=location_argument, help="resumed generation (a directory or a store URL)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    try:
        args = parser.parse_args(argv)
        results, ledgers = compare_inputs(args.a, args.b)
    except TrainerError as error:
        print(f"compare: error: {error}", file=sys.stderr)
        return error.exit_code if error.exit_code in (EXIT_INTERRUPTED, StorageFailure.exit_code,
                                                      UntrustedGeneration.exit_code) else 2
    except KeyboardInterrupt:
        print("compare: interrupted by a signal; nothing was compared", file=sys.stderr)
        return EXIT_INTERRUPTED
    from trainer.inspect.compare import as_json, format_ledgers, format_table

    try:
        print(json.dumps(as_json(args.a, args.b, results, ledgers), indent=2) if args.json
              else format_ledgers(*ledgers) + format_table(results), flush=True)
    except BrokenPipeError:
        # `compare A B | head`: the reader left; the verdict is still the exit status.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if all(r.equal for r in results) else 1


def compare_inputs(a, b) -> tuple[list, tuple[dict, dict]]:
    """Field results of two generations and their sample ledgers; one named by store URL is
    downloaded (verified while it streams) into a temporary directory that is gone afterwards."""
    from trainer.inspect.compare import compare_states, load_generation
    from trainer.inspect.sources import open_source

    collect_after_start_up()
    with tempfile.TemporaryDirectory(prefix="compare-") as scratch:
        first = load_generation(open_source(a).generation(Path(scratch) / "a"))
        second = load_generation(open_source(b).generation(Path(scratch) / "b"))
        return compare_states(first.state, second.state), (first.ledger, second.ledger)


COMMANDS = {"list": run_list, "report": run_report, "verify": run_verify, "compare": run_compare}


def main(argv: list[str] | None = None, program: str = PROGRAM) -> int:
    """`program`: the command the user ran, as usage and `--help` name it."""
    argv = sys.argv[1:] if argv is None else argv
    rank = rank_of(os.environ)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s" if rank == 0 else f"rank {rank}: %(message)s", stream=sys.stdout)
    # torch raises a dead DataLoader worker's error from its SIGCHLD handler, wherever the main
    # thread is; inside a log call, logging would print that as a traceback and go on. The
    # loop sees the dead worker itself at the next batch (one line, trainer/run/failures.py).
    logging.raiseExceptions = False
    sys.excepthook = without_lost_worker_transfers(sys.excepthook)
    for chatty in ("botocore", "aiobotocore", "s3fs", "fsspec"):  # credential lookups at INFO
        logging.getLogger(chatty).setLevel(logging.WARNING)
    command = COMMANDS.get(argv[0]) if argv else None
    try:
        status = command(argv[1:], program) if command else run_train(argv, program)
    except TrainerError as error:
        sys.stdout.flush()
        if rank == 0:
            print(f"trainer: error: {error}", file=sys.stderr)
        elif not getattr(error, "reported_by_primary", False):
            print(f"trainer: rank {rank}: error: {error}", file=sys.stderr)
        status = error.exit_code
    except BrokenPipeError:
        # `list DIR | head`: the reader left; stop quietly, as other command-line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as error:  # any I/O error is the environment's, not a bug: one line, 74
        print(f"trainer: error: {storage_failure(error, 'reading or writing the output')}", file=sys.stderr)
        status = 74
    if command is None:
        report_exit_status(status)
    return status


def without_lost_worker_transfers(previous):
    """`previous`, except for the connection error multiprocessing's fd-sharing thread prints
    when a DataLoader worker dies while handing a batch over: the loop reports the dead worker
    itself, in one line."""
    def hook(kind, value, trace) -> None:
        if isinstance(value, ConnectionError) and any(
                frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "resource_sharer.py"))
                for frame, _ in traceback.walk_tb(trace)):
            return
        previous(kind, value, trace)
    return hook


def report_exit_status(status: int) -> None:
    """torchrun exits 1 whenever a child exits non-zero, 75 included, so whatever runs it
    cannot tell "resumable" from "broken". With TRAINER_EXIT_STATUS_FILE set, the first
    process of each node (LOCAL_RANK 0) also writes its exit status there, for a launcher
    script to exit with (polyaxonfiles/pytorchjob.yaml does). All ranks exit with the same
    status when they stop together (0, 75, or an error rank 0 decided for all). Best effort:
    if the file cannot be written, the launcher falls back to torchrun's own status."""
    path = os.environ.get(EXIT_STATUS_ENV)
    if not path or local_rank_of(os.environ) != 0:
        return
    try:
        Path(path).write_text(f"{status}\n")
    except OSError:
        pass


def exit_process(status: int) -> NoReturn:
    """Leave with `status`. A single process exits normally. One of several processes
    (torchrun, the training operator) skips the interpreter's teardown: its outcome is
    already on disk (generations fsync'd and published, attempt record and status file
    written, process group destroyed), and on Python 3.11 torch's C++ threads can race
    the teardown and abort (SIGABRT, "terminate called without an active exception";
    seen once in CI on a completed FSDP run), turning a finished rank into a crash that
    torchrun reports for the whole job. Exit handlers (Polyaxon's event flush among
    them) and the standard streams still run and flush first."""
    if not is_multi_process(os.environ):
        sys.exit(status)
    exit_without_interpreter_teardown(status)


def exit_without_interpreter_teardown(status: int) -> NoReturn:
    """`exit_process`'s way for one of several processes, for a caller that knows it is one:
    a distributed library run's exit handler (Lightning's environment deletes WORLD_SIZE at the
    end of `fit`, and `sys.exit` in an exit handler is an exception printed, not an exit)."""
    try:
        compat.run_exit_handlers()  # the handlers a normal exit runs
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)
