"""Command line: parse options into frozen config, run, and map typed errors to exit codes.

This is the only module that prints errors or chooses exit statuses. Every failure a user
or operator can cause ends as one line on stderr and a sysexits-style status, never a
traceback. Under torchrun, rank 0 prints `trainer: error: ...`; another rank prints its own
failure as `trainer: rank N: error: ...` and stays silent about an error rank 0 already
reported for every rank. Ranks other than 0 log only warnings, prefixed with their rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from trainer import compat, seams
from trainer.config import (CHECKPOINT_MODES, DEFAULT_WORKLOAD, CadenceConfig, ProgressConfig, RetentionConfig,
                            RunConfig, StoreConfig, WorkloadConfig)
from trainer.errors import EXIT_INTERRUPTED, TrainerError, UsageError, storage_failure
from trainer.run.fingerprint import FIELDS
from trainer.parallel.launch import LaunchEnvironment, is_multi_process, local_rank_of, rank_of
from trainer.options import (location_argument, non_negative_float, non_negative_int, path_argument, positive_float,
                             positive_int)
from trainer.storage.location import parse_store_url

EXIT_STATUS_ENV = "TRAINER_EXIT_STATUS_FILE"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit 2."""

    help_command: str | None = None
    """What lists every option (a workload's own appear only with `--workload X --help`)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.help_command or self.prog + ' --help'})")


def train_parser(workload: str = DEFAULT_WORKLOAD) -> OneLineParser:
    """Every option of a training run, the chosen workload's own included (so `--help`
    lists them)."""
    return workload_parser(workload)[0]


def workload_parser(workload: str) -> tuple[OneLineParser, tuple[str, ...]]:
    """The training parser with `workload`'s options, and their names."""
    from trainer.workload.loading import find_factory  # imports the workload (and torch)

    parser = trainer_parser()
    trainer_names = set(vars(parser.parse_known_args([])[0]))
    found = find_factory(workload)
    declared = found.add_options(parser.add_argument_group(f"options of the workload {workload}"))
    if workload != DEFAULT_WORKLOAD:
        parser.help_command = f"{parser.prog} --workload {workload} --help"
    if clashes := sorted(set(declared) & trainer_names):
        raise UsageError(f"--workload {workload} declares {', '.join(clashes)}, which the trainer already has; "
                         f"rename them in its add_options")
    return parser, tuple(declared)


def chosen_workload(argv: list[str]) -> str:
    """Phase one of parsing: only `--workload`, so its options can join the parser."""
    finder = OneLineParser(add_help=False)
    finder.add_argument("--workload", default=DEFAULT_WORKLOAD)
    return finder.parse_known_args(argv)[0].workload


def trainer_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m trainer",
                           description="Train with exact, crash-safe recovery. "
                                       "Other commands: `list DIR|URL`, `report DIR|URL`, `verify DIR|GEN|URL`.")
    parser.add_argument("--output", type=location_argument,
                        help="run directory (generations, exports, attempt records): a local path, or a store "
                             "URL s3://BUCKET/PREFIX (gs://, az://) to make every generation durable there")
    parser.add_argument("--tracked", action="store_true",
                        help="track with Polyaxon (in a Polyaxon job, or anywhere with POLYAXON_IS_OFFLINE=true); "
                             "the run directory is the run's outputs in its artifacts store when the container "
                             "reaches the store (mountArtifactsStore), else its outputs path; replaces --output")
    store = parser.add_argument_group("object store (with --output s3://…, gs://…, az://…)")
    store.add_argument("--local-tier", type=path_argument, metavar="DIR",
                       help="this machine's working copy of the run (default: "
                            "$TRAINER_LOCAL_TIER or the temp dir, /training-recovery/SCHEME/BUCKET/PREFIX; "
                            "under --tracked $TRAINER_LOCAL_TIER/RUN_UUID)")
    store.add_argument("--max-pending-uploads", type=non_negative_int, default=StoreConfig.max_pending_uploads,
                       metavar="N", help="saves published locally but not yet durable before a save waits "
                                         "(default %(default)s; 0: every save waits until durable)")
    store.add_argument("--store-retries", type=non_negative_int, default=StoreConfig.retries, metavar="N",
                       help="retries of a failed store request before exit 74 (default %(default)s)")
    store.add_argument("--store-backoff-secs", type=positive_float, default=StoreConfig.backoff_s, metavar="S",
                       help="first wait between retries, doubled each time, at most 8 s (default %(default)s)")
    store.add_argument("--store-timeout-secs", type=positive_float, default=StoreConfig.timeout_s, metavar="S",
                       help="connect and read timeout of one store request (default %(default)s)")
    store.add_argument("--lease-ttl-secs", type=positive_float, default=StoreConfig.lease_ttl_s, metavar="S",
                       help="the single-writer lease expires this long after its last renewal (default "
                            "%(default)s)")
    store.add_argument("--lease-wait-secs", type=non_negative_float, metavar="S",
                       help="how long to wait for a held lease to expire before exit 73 (default: the "
                            "holder's ttl + 5 s)")
    run = parser.add_argument_group("recovery")
    run.add_argument("--resume", nargs="?", const="latest", choices=("latest", "auto"),
                     help="continue from the newest verified generation (latest: one must exist; "
                          "auto: start fresh if none)")
    run.add_argument("--from-generation", metavar="NAME", help="restore this generation (e.g. step-00000016)")
    run.add_argument("--interrupt-at-step", type=positive_int, metavar="N",
                     help="simulate a lost worker: exit 75 right after step N, without saving")
    run.add_argument("--allow-drift", action="append", default=[], choices=FIELDS, metavar="FIELD",
                     help=f"accept a fingerprint difference in FIELD ({', '.join(FIELDS)}); repeatable")
    run.add_argument("--checkpoint-mode", default="auto", choices=CHECKPOINT_MODES,
                     help="how recovery snapshots are written (sync: in the loop; async: staged to host "
                          "memory and written in the background; auto: async on CUDA, sync on CPU)")
    run.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    run.add_argument("--preempt-grace-secs", type=positive_float, default=20.0,
                     help="on SIGTERM/SIGINT, time allowed to save before exiting 75 without publishing "
                          "(default 20: below Kubernetes' default 30 s termination grace)")
    run.add_argument("--max-failed-attempts", type=non_negative_int, default=3, metavar="N",
                     help="exit 70 instead of retrying when the last N attempts restored the same "
                          "generation and died before publishing a newer one (0 = never)")

    cadence = parser.add_argument_group("cadence (any trigger that is set fires)")
    cadence.add_argument("--recover-every-epochs", type=non_negative_int, default=1, metavar="N",
                         help="recovery generation every N epochs (0 = off; default 1)")
    cadence.add_argument("--recover-every-steps", type=positive_int, metavar="N")
    cadence.add_argument("--recover-every-secs", type=positive_float, metavar="S")
    cadence.add_argument("--export-every-epochs", type=positive_int, metavar="N",
                         help="safetensors export every N epochs (default: only at the end)")
    cadence.add_argument("--export-every-steps", type=positive_int, metavar="N")
    cadence.add_argument("--export-every-secs", type=positive_float, metavar="S")
    cadence.add_argument("--export-dtype", choices=("float32", "float16", "bfloat16"),
                         help="dtype of exported weights (default: the training dtype)")

    keep = parser.add_argument_group("retention")
    keep.add_argument("--keep-last", type=positive_int, default=3, metavar="K",
                      help="newest verified generations kept (default 3; keep >= 2 on clusters)")
    keep.add_argument("--keep-every", type=positive_int, metavar="M",
                      help="also keep generations whose step is a multiple of M")
    keep.add_argument("--keep-exports", type=positive_int, metavar="K", help="newest exports kept (default all)")

    shown = parser.add_argument_group("progress (when stdout is not a terminal; a terminal gets a status line)")
    shown.add_argument("--log-every-steps", type=positive_int, default=ProgressConfig.every_steps, metavar="N",
                       help=f"a progress line every N global steps (1 = every step; default "
                            f"{ProgressConfig.every_steps}), and always the first and last step of an attempt")
    shown.add_argument("--log-every-secs", type=positive_float, default=ProgressConfig.every_secs, metavar="S",
                       help=f"also a line when S seconds passed since the previous one (default "
                            f"{ProgressConfig.every_secs:g})")

    work = parser.add_argument_group("training")
    defaults = WorkloadConfig()
    work.add_argument("--workload", default=DEFAULT_WORKLOAD, metavar="MODULE:FACTORY",
                      help="what to train: a factory returning a trainer.workload.protocol.Workload; MODULE is "
                           "importable (current directory or PYTHONPATH) or a path to a .py file "
                           f"(default {DEFAULT_WORKLOAD}); its options are listed below")
    work.add_argument("--epochs", type=positive_int, default=defaults.epochs)
    work.add_argument("--batch-size", type=positive_int, default=defaults.batch_size,
                      help="samples per (micro-)batch, across all processes")
    work.add_argument("--grad-accum", type=positive_int, default=defaults.grad_accum, metavar="N",
                      help="micro-batches per optimizer step; steps, cadence and the LR schedule count "
                           "optimizer steps, and saves happen only between them (default 1)")
    work.add_argument("--seed", type=non_negative_int, default=defaults.seed)
    work.add_argument("--num-workers", type=non_negative_int, default=defaults.num_workers)
    work.add_argument("--amp", action="store_true", help="mixed precision (bf16 on CPU, fp16+GradScaler on CUDA)")
    work.add_argument("--threads", type=positive_int, default=defaults.threads)
    work.add_argument("--data-parallel", choices=("ddp", "fsdp"), default=defaults.data_parallel,
                      help="under torchrun: ddp replicates the model on every rank; fsdp shards parameters, "
                           "gradients and optimizer state across ranks (FSDP2) for models too large to "
                           "replicate (default ddp)")
    return parser


def check_option_combinations(args: argparse.Namespace, launch: LaunchEnvironment) -> None:
    """Cheap checks that need no import, done before tracking or torch start."""
    if launch.world_size > 1 and args.checkpoint_mode == "async":
        raise UsageError("--checkpoint-mode async is single-process only; under torchrun use "
                         "--checkpoint-mode sync (or auto)")
    if args.data_parallel == "fsdp" and launch.world_size == 1:
        raise UsageError("--data-parallel fsdp shards the model across processes and needs torchrun with "
                         "--nproc_per_node 2 or more; drop it for a single-process run")
    if args.tracked and args.output is not None:
        raise UsageError("--output and --tracked are exclusive: with --tracked the run directory is "
                         "the Polyaxon run's (in its artifacts store, or its outputs path); drop --output")
    if not args.tracked and args.output is None:
        raise UsageError("--output DIR is required (the run directory); e.g. --output outputs/run1, "
                         "or --tracked to use Polyaxon's outputs path")
    if not args.tracked:  # tracked: known once the run's artifacts store is (tracked_placement)
        require_store_for_store_options(args, isinstance(args.output, str))
    if args.lease_ttl_secs < 1:
        raise UsageError(f"--lease-ttl-secs {args.lease_ttl_secs:g} is too short to renew over a network; "
                         f"use 1 or more (default {StoreConfig.lease_ttl_s:g})")
    if args.resume is not None and args.from_generation is not None:
        raise UsageError("--resume and --from-generation are exclusive; --from-generation already resumes")


def require_store_for_store_options(args: argparse.Namespace, in_store: bool) -> None:
    store_options = [f"--{name.replace('_', '-')}" for name, default in STORE_DEFAULTS.items()
                     if getattr(args, name) != default]
    if store_options and not in_store:
        where = ("the run's artifacts store is not a bucket exposed to the container (polyaxonfile plugin "
                 "mountArtifactsStore)" if args.tracked else "pass --output s3://BUCKET/PREFIX")
        raise UsageError(f"{', '.join(store_options)} apply only to a run directory in a store; {where}, "
                         f"or drop them")


STORE_DEFAULTS = {"local_tier": None, "max_pending_uploads": StoreConfig.max_pending_uploads,
                  "store_retries": StoreConfig.retries, "store_backoff_secs": StoreConfig.backoff_s,
                  "store_timeout_secs": StoreConfig.timeout_s, "lease_ttl_secs": StoreConfig.lease_ttl_s,
                  "lease_wait_secs": None}


def config_from_args(args: argparse.Namespace, argv: list[str], output: Path | str | None,
                     workload_options: tuple[str, ...], local_tier: Path | None = None) -> RunConfig:
    workload = WorkloadConfig(
        epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers,
        amp=args.amp, threads=args.threads, data_parallel=args.data_parallel, grad_accum=args.grad_accum,
        workload=args.workload,
        options=tuple((name, getattr(args, name)) for name in workload_options))
    store = None
    if isinstance(output, str):  # a store URL: `output` becomes this machine's local tier of it
        store = output
        output = args.local_tier or local_tier or parse_store_url(store).default_local_tier()
    return RunConfig(
        store=store, store_config=StoreConfig(
            retries=args.store_retries, backoff_s=args.store_backoff_secs, timeout_s=args.store_timeout_secs,
            max_pending_uploads=args.max_pending_uploads, lease_ttl_s=args.lease_ttl_secs,
            lease_wait_s=args.lease_wait_secs),
        output=output, workload=workload, interrupt_at_step=args.interrupt_at_step,
        resume=args.resume, from_generation=args.from_generation,
        allow_drift=tuple(dict.fromkeys(args.allow_drift)), checkpoint_mode=args.checkpoint_mode,
        device=args.device,
        recover=CadenceConfig(args.recover_every_epochs or None, args.recover_every_steps, args.recover_every_secs),
        export=CadenceConfig(args.export_every_epochs, args.export_every_steps, args.export_every_secs),
        export_dtype=args.export_dtype,
        retention=RetentionConfig(args.keep_last, args.keep_every, args.keep_exports),
        preempt_grace_secs=args.preempt_grace_secs,
        progress=ProgressConfig(args.log_every_steps, args.log_every_secs),
        max_failed_attempts=args.max_failed_attempts, argv=tuple(argv))


def run_train(argv: list[str]) -> int:
    launch = LaunchEnvironment.from_environ(os.environ)
    parser, workload_options = workload_parser(chosen_workload(argv))
    args = parser.parse_args(argv)
    check_option_combinations(args, launch)
    seams.install(seams.Seams.from_environment(os.environ, launch.rank))
    if not args.tracked:
        return train_in(config_from_args(args, argv, args.output, workload_options), launch)
    if launch.rank != 0:
        # Under torchrun only rank 0 talks to Polyaxon. Every rank finds the run's store itself
        # (pods share no filesystem); without one, the others learn rank 0's outputs path.
        placement = tracked_placement(args, launch)
        return train_in(config_from_args(args, argv, placement.output, workload_options, placement.local_tier),
                        launch)
    from trainer.integrations.polyaxon.tracking import PolyaxonEvents  # imports polyaxon: only with --tracked

    events = PolyaxonEvents.start()

    def train_tracked(outputs: Path) -> int:
        placement = tracked_placement(args, launch, events.run_uuid)
        events.place(placement)
        refuse_a_racing_copy(events, placement)
        return train_in(config_from_args(args, argv, placement.output or outputs, workload_options,
                                         placement.local_tier), launch, events)

    return events.track(train_tracked)


def refuse_a_racing_copy(events, placement) -> None:
    """`ops restart --copy` puts the original run's outputs into this run's context path; with
    the run directory in the store they would arrive there only through the sidecar, after
    this trainer started: nothing to resume yet, then a second line of generations and the
    original's lease object under the live run. Refused (exit 2), naming what to do instead."""
    if placement.direct and events.cloned_as_copy():
        original = events.original_uuid()
        raise UsageError(f"this run is an `ops restart --copy` of run {original}: the copy reaches {placement.output} "
                         f"only through the sidecar, racing this trainer; continue run {original} with "
                         f"`polyaxon ops resume -uid {original} -f presets/resume.yaml` instead")


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


def train_in(config: RunConfig, launch: LaunchEnvironment, events=None) -> int:
    from trainer.run.events import TrainingEvents
    from trainer.run.loop import run_training  # imports torch: after cheap validation

    outcome = run_training(config, launch, events or TrainingEvents())
    if outcome.status == EXIT_INTERRUPTED and launch.is_primary:
        # Resumable, not an error; one line on stderr all the same, where operators look.
        print(f"trainer: stopped, resumable (exit 75): {outcome.reason}; continue with --resume auto",
              file=sys.stderr, flush=True)
    return outcome.status


RUN_OR_URL = "a run directory, or the store URL of one (s3://BUCKET/RUN)"


def run_list(argv: list[str]) -> int:
    parser = OneLineParser(prog="python -m trainer list",
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
    args = parser.parse_args(argv)
    from trainer.inspect.listing import list_run, require_run_directory
    from trainer.inspect.object_store import list_store_run

    if isinstance(args.directory, str):
        if args.store is not None:
            raise UsageError("--store goes with a local run directory; with a URL, name the local tier with "
                             "--local-tier DIR")
        return list_store_run(args.directory, args.local_tier, args.json)
    if args.local_tier is not None:
        raise UsageError("--local-tier goes with a store URL; for a local run directory that is the local tier "
                         "of a run in a store, add --store URL")
    if args.store is None:
        return list_run(args.directory, args.json)
    if not isinstance(args.store, str):
        raise UsageError(f"--store takes a store URL (s3://BUCKET/RUN), not the path {args.store}")
    require_run_directory(args.directory)
    return list_store_run(args.store, args.directory, args.json)


def run_verify(argv: list[str]) -> int:
    parser = OneLineParser(prog="python -m trainer verify",
                           description="Re-hash every file of generations and exports against their manifests.")
    parser.add_argument("path", type=location_argument, metavar="DIR|GEN|URL",
                        help="a run directory or one generation/export directory, or the store URL of either")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    from trainer.inspect.listing import verify_path
    from trainer.inspect.object_store import verify_store

    return verify_store(args.path, args.json) if isinstance(args.path, str) else verify_path(args.path, args.json)


def run_report(argv: list[str]) -> int:
    parser = OneLineParser(prog="python -m trainer report",
                           description="Recovery report: per attempt, steps computed, replayed and lost and what "
                                       "restores and saves cost; goodput and time lost for the run.")
    parser.add_argument("directory", type=location_argument, metavar="DIR|URL", help=RUN_OR_URL)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--png", type=path_argument, metavar="FILE",
                        help="also draw the timeline of the attempts into FILE (PNG, 1600x900)")
    args = parser.parse_args(argv)
    from trainer.inspect.listing import report_command
    from trainer.inspect.object_store import store_report_command

    command = store_report_command if isinstance(args.directory, str) else report_command
    return command(args.directory, args.json, args.png)


COMMANDS = {"list": run_list, "report": run_report, "verify": run_verify}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = rank_of(os.environ)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s" if rank == 0 else f"rank {rank}: %(message)s", stream=sys.stdout)
    for chatty in ("botocore", "aiobotocore", "s3fs", "fsspec"):  # credential lookups at INFO
        logging.getLogger(chatty).setLevel(logging.WARNING)
    command = COMMANDS.get(argv[0]) if argv else None
    try:
        status = command(argv[1:]) if command else run_train(argv)
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
    try:
        compat.run_exit_handlers()  # the handlers a normal exit runs
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)
