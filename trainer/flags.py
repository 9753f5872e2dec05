"""Every training option: its flag, the configuration field it sets, and its help.

The frozen dataclasses in trainer/config.py are the one source of every default: a flag
shows the default of the field it sets and never writes one of its own, and
`config_from_values` builds the configuration by replacing only the fields given. Units:
`_s` in code, `-secs` on the command line.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

from trainer.errors import UsageError
from trainer.config import CHECKPOINT_MODES, TIER0_AUTO, AutoCadenceConfig, RunConfig
from trainer.options import (AUTO, non_negative_float, non_negative_int, path_argument, positive_float,
                             positive_float_or_auto, positive_int, positive_int_or_auto)

DEFAULTS = RunConfig(location=None)
"""Where every flag's default comes from (its location is never read)."""
_WAIT, _PEER_WAIT = DEFAULTS.background_wait, DEFAULTS.peer_wait
AUTO_BOUNDS = {"recover.auto": AutoCadenceConfig(), "memory.auto": TIER0_AUTO}
"""Each auto cadence's bounds unless given: its options set a field of an AutoCadenceConfig
that exists only with `auto` (trainer/cli.py `auto_cadence`), so `config_from_values` leaves them."""


def default_of(path: str):
    """The default of a field named `section.field` (or a field of RunConfig itself), or of an
    auto cadence's bound (`section.auto.field`)."""
    bounds, _, name = path.rpartition(".")
    if bounds in AUTO_BOUNDS:
        return getattr(AUTO_BOUNDS[bounds], name)
    value = DEFAULTS
    for part in path.split("."):
        value = getattr(value, part)
    return value


@dataclass(frozen=True)
class Flag:
    flag: str
    path: str
    """The configuration field it sets: `field` of RunConfig, or `section.field`."""
    help: str
    metavar: str | None = None
    type: Callable | None = None
    options: dict = field(default_factory=dict)
    """More argparse settings (choices, action, nargs, const)."""
    to_config: Callable = lambda value: value
    """From the parsed value to the field's (e.g. 0 → None for "off")."""
    shown_default: object = None
    """The default as the command line spells it, when it differs from the field's."""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def default(self):
        if self.options.get("action") == "append":
            return list(default_of(self.path))
        if self.shown_default is not None:
            return self.shown_default
        return default_of(self.path)


STORE_GROUP = "object store (with --output s3://…, gs://…, az://…)"
MEMORY_GROUP = "memory tier (tier 0, with --memory-dir)"

GROUPS: dict[str, list[Flag]] = {
    STORE_GROUP: [
        Flag("--max-pending-uploads", "store_config.max_pending_uploads", metavar="N", type=non_negative_int,
             help="saves published locally but not yet durable before a save waits (0: every save waits until "
                  "durable)"),
        Flag("--store-retries", "store_config.retries", metavar="N", type=non_negative_int,
             help="retries of a failed object-store request before exit 74 (the run directory's, and a stream's "
                  "reads from a store)"),
        Flag("--store-backoff-secs", "store_config.backoff_s", metavar="S", type=positive_float,
             help="first wait between retries, doubled each time, at most 8 s"),
        Flag("--store-timeout-secs", "store_config.timeout_s", metavar="S", type=positive_float,
             help="connect and read timeout of one object-store request"),
        Flag("--lease-ttl-secs", "store_config.lease_ttl_s", metavar="S", type=positive_float,
             help="the single-writer lease expires this long after its last renewal"),
        Flag("--lease-wait-secs", "store_config.lease_wait_s", metavar="S", type=non_negative_float,
             help="how long to wait for a held lease to expire before exit 73 (default: the holder's ttl + 5 s)"),
    ],
    "recovery": [
        Flag("--resume", "resume", options={"nargs": "?", "const": "latest", "choices": ("latest", "auto")},
             help="continue from the newest verified generation (latest, the same as a bare --resume: one must "
                  "exist; auto: start fresh if none)"),
        Flag("--from-generation", "from_generation", metavar="NAME",
             help="restore this generation (e.g. step-00000016); going back sets later ones aside"),
        Flag("--adopt-from", "adopt_from", metavar="RUN", options={"action": "append"},
             to_config=lambda runs: tuple(dict.fromkeys(runs or ())),
             help="also restore generations of run RUN (its id, as the refusal names it): a generation copied in "
                  "from another run on purpose; recorded in the run directory's run.json; repeatable"),
        Flag("--interrupt-at-step", "interrupt_at_step", metavar="N", type=positive_int,
             help="simulate a lost worker: exit 75 right after step N, without saving"),
        Flag("--allow-drift", "allow_drift", metavar="FIELD", options={"action": "append"},
             to_config=lambda names: tuple(dict.fromkeys(names)),
             help="accept a fingerprint difference in FIELD ({choices}); repeatable"),
        Flag("--checkpoint-mode", "checkpoint_mode", options={"choices": CHECKPOINT_MODES},
             help="how recovery snapshots are written (sync: in the loop; async: staged to host memory and "
                  "written in the background; auto: async on CUDA, sync on CPU)"),
        Flag("--device", "device", options={"choices": ("auto", "cpu", "cuda")},
             help="where to train (auto: CUDA when available)"),
        Flag("--data-parallel-backend", "data_parallel_backend", options={"choices": ("auto", "nccl", "gloo")},
             help="the process group's backend under torchrun (auto: NCCL on CUDA, gloo on the CPU; gloo on CUDA "
                  "lets several processes share one GPU)"),
        Flag("--background-timeout-secs", "background_wait.timeout_s", metavar="S|auto", type=positive_float_or_auto,
             to_config=lambda value: None if value == AUTO else value, shown_default=AUTO,
             help="how long a background collective of an async save waits for another rank before every rank "
                  f"fails in one line naming the rank that failed; auto: {_WAIT.factor:g} x the slowest save "
                  f"measured, at least {_WAIT.floor_s:g} s ({_WAIT.first_s:g} s before the first save)"),
        Flag("--peer-timeout-secs", "peer_wait.timeout_s", metavar="S|auto", type=positive_float_or_auto,
             to_config=lambda value: None if value == AUTO else value, shown_default=AUTO,
             help="how long a rank waits for the others in a collective of training before every rank that "
                  "can act exits 75 naming the rank that did not answer (lost or frozen); auto: "
                  f"{_PEER_WAIT.factor:g} x the slowest step (or step with a save) measured, at least "
                  f"{_PEER_WAIT.floor_s:g} s ({_PEER_WAIT.first_s:g} s before one was measured); a fallback: a "
                  "frozen or dead rank is found by its silence (--peer-silence-secs)"),
        Flag("--peer-silence-secs", "peer_wait.silence_s", metavar="S", type=positive_float,
             help="a rank whose heartbeat has been silent this long is frozen or dead: every other rank ends (75) "
                  "naming it, whatever it waits in, and ends it if it runs on the same host"),
        Flag("--rejoin-timeout-secs", "peer_wait.rejoin_s", metavar="S", type=positive_float,
             help="how long a round restarted by torchrun (--max-restarts) waits for every rank to join before "
                  f"it ends (75) in one line (the first round waits {_PEER_WAIT.first_s:g} s)"),
        Flag("--warm-spare", "warm_spare", options={"action": argparse.BooleanOptionalAction},
             help="under torchrun with --max-restarts: fork each restarted worker from a spare that kept the "
                  "first worker's imports (about 2.5 s less per restart; --no-warm-spare imports afresh)"),
        Flag("--allow-nondeterministic-ops", "allow_nondeterministic_ops", options={"action": "store_true"},
             help="let ops without a deterministic implementation on this device run (torch warns) instead of "
                  "ending the run naming the op; the run is then recorded as not promised exact"),
        Flag("--preempt-grace-secs", "preempt_grace_s", metavar="S", type=positive_float,
             help="on SIGTERM/SIGINT, time allowed to save before exiting 75 without publishing (below "
                  "Kubernetes' default 30 s termination grace)"),
        Flag("--max-failed-attempts", "max_failed_attempts", metavar="N", type=non_negative_int,
             help="exit 70 instead of retrying when the last N attempts restored the same generation and died "
                  "before publishing a newer one (0 = never)"),
    ],
    "cadence (any trigger that is set fires)": [
        Flag("--recover-every-epochs", "recover.every_epochs", metavar="N", type=non_negative_int,
             to_config=lambda value: value or None, help="a recovery generation every N epochs (0 = off)"),
        Flag("--recover-every-steps", "recover.every_steps", metavar="N", type=positive_int,
             help="a recovery generation every N optimizer steps"),
        Flag("--recover-every-secs", "recover.every_s", metavar="S|auto", type=positive_float_or_auto,
             to_config=lambda value: None if value == AUTO else value,
             help="a recovery generation when S seconds passed since the previous one; auto: the interval that "
                  "maximises expected goodput for the measured save cost and the run's failure rate (Daly), "
                  "re-derived after every save (cadence is not fingerprinted)"),
        Flag("--export-every-epochs", "export.every_epochs", metavar="N", type=positive_int,
             help="a safetensors export every N epochs (default: only at the end)"),
        Flag("--export-every-steps", "export.every_steps", metavar="N", type=positive_int,
             help="a safetensors export every N optimizer steps"),
        Flag("--export-every-secs", "export.every_s", metavar="S", type=positive_float,
             help="a safetensors export when S seconds passed since the previous one"),
        Flag("--export-dtype", "export_dtype", options={"choices": ("float32", "float16", "bfloat16")},
             help="dtype of exported weights (default: the training dtype)"),
    ],
    MEMORY_GROUP: [
        Flag("--memory-dir", "memory.directory", metavar="DIR", type=path_argument,
             help="tier 0: also save generations to DIR on a memory filesystem (/dev/shm/RUN; in a pod an emptyDir "
                  "with medium: Memory), outside the process: a restart after a crash or an OOM kill restores "
                  "from there when it is newer than the newest durable generation; under torchrun each node its "
                  "own, and with several nodes each rank's part is replicated to a partner on the next node "
                  "(default: off)"),
        Flag("--memory-every-steps", "memory.every_steps", metavar="N|auto", type=positive_int_or_auto,
             to_config=lambda value: None if value == AUTO else value,
             help="a tier-0 generation every N optimizer steps (the durable cadence stays as it is); auto: N "
                  "from tier 0's measured save cost (the seconds a tier-0 save held the loop) and the run's "
                  "failure rate (Daly, as --recover-every-secs auto), at the attempt's seconds per step, "
                  "re-derived after every tier-0 save; each change is logged and recorded"),
        Flag("--memory-auto-min-secs", "memory.auto.min_s", metavar="S", type=positive_float,
             help="with --memory-every-steps auto: shortest interval in seconds, and the first one until a "
                  "tier-0 save is measured"),
        Flag("--memory-auto-max-secs", "memory.auto.max_s", metavar="S", type=positive_float,
             help="with --memory-every-steps auto: longest interval in seconds"),
        Flag("--memory-keep", "memory.keep", metavar="K", type=positive_int,
             help="newest tier-0 generations kept"),
        Flag("--memory-tier-max-bytes", "memory.max_bytes", metavar="B", type=positive_int,
             help="what tier 0 (K generations, and a peer's replica with several nodes) plus the staging buffers "
                  "of async saves may use, per process; a start that "
                  "cannot fit is refused (exit 2), a save that would not fit is skipped (default: the free space "
                  "of the memory filesystem)"),
    ],
    "retention": [
        Flag("--keep-last", "retention.keep_last", metavar="K", type=positive_int,
             help="newest verified generations kept (keep >= 2 on clusters)"),
        Flag("--keep-every", "retention.keep_every", metavar="M", type=positive_int,
             help="also keep generations whose step is a multiple of M"),
        Flag("--keep-exports", "retention.keep_exports", metavar="K", type=positive_int,
             help="newest exports kept (default: all)"),
    ],
    "progress (when stdout is not a terminal; a terminal gets a status line)": [
        Flag("--log-every-steps", "progress.every_steps", metavar="N", type=positive_int,
             help="a progress line every N global steps (1 = every step), and always the first and last step "
                  "of an attempt"),
        Flag("--log-every-secs", "progress.every_s", metavar="S", type=positive_float,
             help="also a line when S seconds passed since the previous one"),
    ],
    "training": [
        Flag("--workload", "workload.workload", metavar="MODULE:FACTORY",
             help="what to train: a factory returning a trainer.workload.protocol.Workload; MODULE is importable "
                  "(current directory or PYTHONPATH) or a path to a .py file; its options are listed below "
                  "(with --workload X --help, those of X)"),
        Flag("--epochs", "workload.epochs", metavar="N", type=positive_int,
             help="total epochs (a larger value extends a finished run on resume)"),
        Flag("--max-steps", "workload.max_steps", metavar="N", type=positive_int,
             help="total optimizer steps across epochs (a stream's step budget); decides the run's length "
                  "instead of --epochs (a larger value extends a finished run on resume)"),
        Flag("--shuffle-buffer", "workload.shuffle_buffer", metavar="N", type=positive_int,
             help="streaming data: records per deterministic shuffle block; a resume re-reads at most one"),
        Flag("--stream-lanes", "workload.stream_lanes", metavar="N", type=positive_int,
             help="streaming data: lanes each epoch is laid out in, fixed for the run (unset: the world size it "
                  "starts with), so the order is the same at every world size; reading stays once per epoch where the world size divides N (pick N with "
                  "many divisors, e.g. 12 or 24)"),
        Flag("--last-batch", "workload.last_batch", options={"choices": ("pad", "drop", "refuse")},
             help="an epoch's ragged last batch: pad trains it (shares weighted, each sample counted once), "
                  "drop leaves it untrained (report counts it), refuse stops a run that cannot share it evenly"),
        Flag("--batch-size", "workload.batch_size", metavar="N", type=positive_int,
             help="samples per (micro-)batch, across all processes (unset: a DataLoader returned by the "
                  "workload's build_dataset gives it)"),
        Flag("--grad-accum", "workload.grad_accum", metavar="N", type=positive_int,
             help="micro-batches per optimizer step; steps, cadence and the LR schedule count optimizer steps, "
                  "and saves happen only between them"),
        Flag("--seed", "workload.seed", metavar="N", type=non_negative_int,
             help="seeds the model, the batch order and every sample's randomness"),
        Flag("--num-workers", "workload.num_workers", metavar="N", type=non_negative_int,
             help="DataLoader worker processes (may change between attempts: it does not change training; "
                  "unset: a DataLoader returned by the workload's build_dataset gives it)"),
        Flag("--amp", "workload.amp", options={"action": "store_true"},
             help="mixed precision (bf16 on CPU, fp16+GradScaler on CUDA)"),
        Flag("--threads", "workload.threads", metavar="N", type=positive_int,
             help="intra-op CPU threads (fixed, so reductions run in the same order on resume)"),
        Flag("--data-parallel", "workload.data_parallel", options={"choices": ("ddp", "fsdp")},
             help="under torchrun: ddp replicates the model on every rank; fsdp shards parameters, gradients "
                  "and optimizer state across ranks (FSDP2) for models too large to replicate"),
        Flag("--gradient-reduction", "workload.gradient_reduction",
             options={"choices": ("fixed-buckets", "per-parameter", "bucketed")},
             help="under torchrun with ddp: fixed-buckets all-reduces flat buckets of a fixed composition while "
                  "backward runs, so a resume is bit-exact at any world size; per-parameter (exact too) all-reduces "
                  "each gradient on its own; bucketed is DDP's own all-reduce of its buckets, exact only up to 2 "
                  "processes (a resume that names none keeps its generation's)"),
    ],
}


class ShowDefaults(argparse.RawDescriptionHelpFormatter):
    """Every option with a default shows it, unless its help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "(default" in text or default is None or default is False or default == [] or \
                default == argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def add_flags(parser: argparse.ArgumentParser, allowed_drift: tuple[str, ...]) -> dict[str, argparse._ArgumentGroup]:
    """Every flag, in its group; returns the groups by title (so others can join one)."""
    groups = {}
    for title, flags in GROUPS.items():
        group = groups[title] = parser.add_argument_group(title)
        for flag in flags:
            options = {"metavar": flag.metavar, "type": flag.type, **flag.options}
            if flag.dest == "allow_drift":
                options["choices"] = allowed_drift
            group.add_argument(flag.flag, default=flag.default(), help=flag.help.replace("{choices}",
                               ", ".join(allowed_drift)), **{key: value for key, value in options.items()
                                                              if value is not None})
    return groups


ALL_FLAGS = tuple(flag for flags in GROUPS.values() for flag in flags)


def config_from_values(args: argparse.Namespace, workload_options: tuple[tuple[str, object], ...],
                       **given) -> RunConfig:
    """The configuration the flags in `args` describe, the workload's own options, and the
    `given` fields of RunConfig (location, signing, argv) as they are."""
    top, nested = dict(given), {"workload": {"options": workload_options}}
    for flag in ALL_FLAGS:
        section, _, name = flag.path.rpartition(".")
        if section in AUTO_BOUNDS:
            continue
        (nested.setdefault(section, {}) if section else top)[name] = flag.to_config(getattr(args, flag.dest))
    return replace(DEFAULTS, **top, **{section: replace(default_of(section), **values)
                                       for section, values in nested.items()})


LOADER_SETTINGS = ("batch_size", "num_workers")
"""The training options a DataLoader returned by `build_dataset` fills where the command line
leaves them unset (trainer/workload/adapters.py `from_loader`)."""
GIVEN_SETTINGS = (*LOADER_SETTINGS, "gradient_reduction")
"""The training options whose default yields to something else where the command line leaves
them unset: a DataLoader's settings, and a resumed generation's reduction (`kept_reduction`)."""


def given_settings(parser: argparse.ArgumentParser, argv: list[str]) -> frozenset[str]:
    """Which of GIVEN_SETTINGS the command line set, even to its default value: argparse
    fills a default only where the namespace holds nothing yet."""
    unset = object()
    seen = parser.parse_args(argv, argparse.Namespace(**{name: unset for name in GIVEN_SETTINGS}))
    return frozenset(name for name in GIVEN_SETTINGS if getattr(seen, name) is not unset)


REQUEST_FLAGS = ("--store-retries", "--store-backoff-secs", "--store-timeout-secs")
"""Store flags that also govern a stream's reads from an object store (the workload's factory is
handed them: trainer/workload/objects.py), so a run directory on disk takes them too."""


def changed_store_flags(args: argparse.Namespace) -> list[str]:
    """The object-store flags for a run directory in a store that the command line set to
    something other than their defaults (`REQUEST_FLAGS` left out)."""
    return [flag.flag for flag in GROUPS[STORE_GROUP]
            if flag.flag not in REQUEST_FLAGS and getattr(args, flag.dest) != flag.default()]


def changed_memory_flags(args: argparse.Namespace) -> list[str]:
    """The tier-0 flags other than --memory-dir that the command line set to something else than their defaults."""
    return [flag.flag for flag in GROUPS[MEMORY_GROUP][1:] if getattr(args, flag.dest) != flag.default()]


def keyword_of(flag: Flag, value: object = None) -> str:
    """`flag` as `open_run`'s keyword spells it (`recover=CadenceConfig(every_steps=5)`,
    `resume='auto'`), with `value` (the field's value) or, without one, the bare flag's: its
    `const` (`--resume` alone is `resume='latest'`)."""
    section, _, name = flag.path.rpartition(".")
    if value is None:
        value = True if flag.options.get("action") == "store_true" else flag.options.get("const")
    shown = name if value is None else f"{name}={tuple(value) if isinstance(value, list) else value!r}"
    if not section:
        return shown
    return f"{section}={type(default_of(section)).__name__}({shown})"


def unknown_keyword(given: dict, function: str) -> None:
    """Refuse (UsageError) a keyword of `function` that is not a RunConfig field, naming the
    nearest one and every one: Python's own TypeError would be a traceback."""
    # `location` is the run directory, open_run's first argument; `argv` is the process's own
    known = [item.name for item in fields(RunConfig) if item.name not in ("location", "argv")]
    for name in given:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise UsageError(f"{function}() has no option {name!r}; {hint}its options: {', '.join(known)}")


def checked_config(config: RunConfig, allowed_drift: tuple[str, ...]) -> RunConfig:
    """`config` as given to `open_run`, checked against what the command line accepts, by the
    same flags (their types and choices): a bad value is a UsageError (exit 2) naming the
    keyword, the value and what is allowed. Returns it normalised as the command line
    normalises a flag's value (`recover=CadenceConfig(every_epochs=0)` is off, as
    `--recover-every-epochs 0`)."""
    changed: dict[str, dict[str, object]] = {}
    for flag in ALL_FLAGS:
        section, _, name = flag.path.rpartition(".")
        if section in AUTO_BOUNDS:
            continue
        owner = getattr(config, section) if section else config
        expected = type(default_of(section)) if section else RunConfig
        if not isinstance(owner, expected):
            raise UsageError(f"{section}={owner!r}: must be a {expected.__name__}, e.g. "
                             f"{section}={expected.__name__}()")
        value = getattr(owner, name)
        optional = "None" in str(next(item.type for item in fields(owner) if item.name == name))
        normal = value if value is None and optional else _checked_value(flag, value, allowed_drift, optional)
        if normal is not value:
            changed.setdefault(section, {})[name] = normal
    top = changed.pop("", {})
    return replace(config, **top, **{section: replace(getattr(config, section), **values)
                                     for section, values in changed.items()})


def _checked_value(flag: Flag, value: object, allowed_drift: tuple[str, ...], optional: bool) -> object:
    """`value` of `flag`'s field, normalised, or a UsageError saying what is allowed."""
    if value == default_of(flag.path):
        return value
    if value is None:
        raise UsageError(f"{keyword_of(flag, value)}: must be set (its default: "
                         f"{keyword_of(flag, default_of(flag.path))})")
    choices = allowed_drift if flag.dest == "allow_drift" else flag.options.get("choices")
    if flag.options.get("action") == "append":
        if isinstance(value, str) or not isinstance(value, (tuple, list)) or \
                not all(isinstance(item, str) for item in value):
            raise UsageError(f"{keyword_of(flag, value)}: must be a tuple of names, e.g. "
                             f"{keyword_of(flag, ((choices or ('NAME',))[0],))}")
        if choices and (wrong := [item for item in value if item not in choices]):
            raise UsageError(f"{keyword_of(flag, value)}: {wrong[0]!r} is not one of {', '.join(choices)}")
        return flag.to_config(value)
    if flag.options.get("action") == "store_true":
        if not isinstance(value, bool):
            raise UsageError(f"{keyword_of(flag, value)}: must be True or False")
        return value
    if choices:
        if value not in choices:
            raise UsageError(f"{keyword_of(flag, value)}: must be one of "
                             f"{', '.join(repr(choice) for choice in choices)}{' or None' if optional else ''}")
        return value
    if flag.type is None:
        if not isinstance(value, str):
            raise UsageError(f"{keyword_of(flag, value)}: must be a string")
        return value
    try:
        parsed = flag.type(str(value)) if not isinstance(value, bool) else None
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"{keyword_of(flag, value)}: {error}") from None
    if parsed is AUTO or parsed is None or (parsed != value and not isinstance(parsed, Path)):
        kind = "a path" if flag.type is path_argument else "a number"
        raise UsageError(f"{keyword_of(flag, value)}: must be {kind}, got {value!r} ({type(value).__name__})")
    normal = flag.to_config(parsed)
    return value if normal == value else normal
