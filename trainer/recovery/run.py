"""`RecoveryRun`: the trainer's recovery inside a loop the user owns.

Five verbs: `open_run` (claim the run directory as `python -m trainer` does: lock or lease,
`run.json`, the generation chosen and verified, an attempt record), `restore` (the caller's
objects, in place, from that generation: fingerprint, signature, run identity and the
witness's restore check; RNGs last), `step` (once per optimizer step: the witness's digest,
the cadences, preemption), `save`, and `close` (the outcome recorded; leaving the `with`
block closes). Everything is the trainer's own machinery (`trainer/run/session.py` for the
claim, the record and the end; `CadencedSaves` for saving; `Restorer` for restoring): the
generations, manifests and records are the ones `list`, `verify`, `report` and `compare.py`
read, and there is no second implementation of a save or a restore.

How an attempt ends is a process exit, as for the trainer: a stop signal saves a generation
at the step reached and, at the next `step()` (one more step, digested for the witness and not
saved), raises `Stopped` (a SystemExit with status 75, resumable), and so does
`interrupt_at_step` (at once); a refusal (65, 66, 73, ...) is one logged line and a SystemExit
with its status. A completed run exits the `with` block normally, after a final generation
and export.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NoReturn

import torch

from trainer import compat
from trainer.cli import exit_without_interpreter_teardown, report_exit_status
from trainer.config import RunConfig
from trainer.flags import checked_config, unknown_keyword
from trainer.errors import EXIT_INTERRUPTED, EXIT_OK, TrainerError, UsageError, option
from trainer.parallel.launch import LaunchEnvironment
from trainer.parallel.ranks import Ranks, StepAgreement, process_group
from trainer.run.cadence import StepPoint
from trainer.run.events import TrainingEvents
from trainer.run.fingerprint import FIELDS
from trainer.run.preemption import PreemptionGuard, ignore_late_stop_requests, restore_stop_handlers, stop_handlers
from trainer.run.readback import StepReadback, next_point, record_step
from trainer.run.records import COMPLETED, INTERRUPTED, PREEMPTED
from trainer.run.runtime import resolve_device
from trainer.run.state import Progress, TrainingState
from trainer.location import parse_location
from trainer.workload import BoundWorkload
from trainer.recovery.bundle import bundle_options, bundled
from trainer.data import keyed
from trainer.data.keyed import UnkeyedData
from trainer.recovery.parallel import data_parallel_settings, plain_model
from trainer.recovery.said import announced, spelled

if TYPE_CHECKING:
    from trainer.run.session import AttemptSession, Outcome

log = logging.getLogger("trainer")


class Stopped(SystemExit):
    """The attempt stopped resumably (exit 75): preempted after saving, or `interrupt_at_step`."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome.status)
        self.outcome = outcome


class OwnLoop:
    """The user's objects as the trainer's workload protocol sees them (nothing is built here)."""

    def __init__(self, extras: dict, architecture: dict):
        self.extras, self._architecture = extras, architecture

    def architecture(self) -> dict:
        return self._architecture

    def stateful(self) -> dict:
        return self.extras


def open_run(output: str | os.PathLike | None = None, config: RunConfig | None = None, **fields) -> RecoveryRun:
    """A run directory (a path or a store URL such as s3://bucket/run) to hold with `with`.
    `fields` are RunConfig's (`resume="auto"`, `recover=CadenceConfig(every_steps=50)`, ...),
    with the same defaults as the command line; `config` gives all of them at once. Run by the
    bundle (`python -m trainer.recovery`), the bundle's run directory and options win."""
    try:
        unknown_keyword(fields, "open_run")
        if config is None:
            config = RunConfig(location=parse_location(os.fspath(output)) if output is not None else None)
        config = checked_config(replace(config, argv=config.argv or tuple(sys.argv), **fields), FIELDS)
        if (options := bundle_options()) is not None:
            config, events = bundled(config, options)
            if events is not None:
                return RecoveryRun(config, events, closing=events.close)
        if config.location is None:
            raise UsageError("open_run needs a run directory (a path or a store URL) or a RunConfig")
    except TrainerError as error:
        said_and_exit(error)
    return RecoveryRun(config)


class KeyedData(keyed.KeyedData):
    """`trainer.data.keyed.KeyedData` as `recovery` hands it out: its settings checked as the
    command line checks the flags that set them, and a mistake (`KeyedData(batch_size=-1)`, a
    dataset that is neither map-style nor a stream) one line and exit 2 wherever it is built,
    inside the `with` block or before it."""

    def __post_init__(self) -> None:
        try:
            checked_config(RunConfig(location=None, workload=self.settings()), ())
            super().__post_init__()
        except UsageError as error:  # the settings' keyword is KeyedData's, not open_run's `workload=`
            said_and_exit(UsageError(Exception.__str__(error).replace("workload=WorkloadConfig(", "KeyedData(", 1)))


def said_and_exit(error: TrainerError) -> NoReturn:
    """A mistake found outside the `with` block (which says its own): one line and its status."""
    log.error("trainer: error: %s", spelled(error))
    raise SystemExit(error.exit_code) from error


class Phases:
    """What a run can do now: the verbs need the state `restore()` handed over, inside the
    `with` block; after the attempt ended only `progress` (where it ended) and the rank remain.
    Anything else is one line and exit 2 (`misused`), never an AttributeError."""

    session: AttemptSession | None  # set by RecoveryRun
    ranks: Ranks | None
    state: TrainingState | None
    ended: Progress | None = None
    """Where the attempt ended (completed, stopped or failed): `progress` after the block."""
    closed = False
    """The `with` block was left: the run directory, the signals and the group are let go."""

    @property
    def progress(self) -> Progress:
        """Where training is; after the `with` block, where the attempt ended."""
        if self.state is None:
            return self.ended or self.misused("progress")
        return self.state.progress

    @property
    def rank(self) -> int:
        """This process's rank (0 in one process): rank 0 is the one that logs and records."""
        return (self.ranks or self.misused("rank")).rank

    @property
    def world_size(self) -> int:
        return (self.ranks or self.misused("world_size")).world_size

    def restored(self, verb: str) -> TrainingState:
        """The state `verb` works on, or one line saying why there is none (`misused`)."""
        return self.state or self.misused(verb)

    def misused(self, verb: str):
        """A verb called where it cannot work: one line and exit 2, as any usage mistake. Inside
        the `with` block a UsageError, which leaving the block says; outside it, said here."""
        if self.closed:
            problem = (f"{verb} after the `with` block: the run is closed (run.progress still says where it "
                       f"ended); call it inside the block")
        elif self.session is None:
            problem = f"{verb} outside `with recovery.open_run(...) as run:`; open the run first"
        elif self.ended is not None:
            problem = f"{verb} after the attempt ended (at step {self.ended.global_step}); leave the `with` block"
        else:
            problem = f"{verb} before restore(): hand over the model and optimizer with restore() first"
        error = UsageError(problem)
        if self.session is not None and not self.closed:
            raise error
        said_and_exit(error)

    def let_go(self) -> None:
        """The attempt ended: no verb works on the state any more; `progress` says where it ended."""
        self.ended, self.state = self.state.progress, None


class Reading(Phases):
    """The data side of a run: the epochs and the keyed batches of each, and what each step consumed."""

    data: keyed.KeyedData | None = None
    saves = None  # set by restore()

    def epochs(self, total: int) -> Iterator[int]:
        """The epochs left of `total`, each to be read with `batches()`."""
        self.restored("epochs()")
        while self.progress.epoch < total:
            epoch = self.progress.epoch
            yield epoch
            if self.progress.epoch == epoch:
                raise UsageError(f"epoch {epoch} did not end: read it with batches() and call step() once per batch")

    def batches(self) -> Iterator:
        """The rest of the current epoch in the keyed order, one batch per `step()`, or with
        `KeyedData(grad_accum=N)` N micro-batches per `step()` (`window_ends` says at which;
        an epoch's last window may be shorter). Under torchrun each rank gets its share of
        every global batch (`KeyedData.batch_size` is the global batch), as the trainer's own
        loop shares it."""
        self.restored("batches()")
        if self.data is None:
            raise UsageError("batches() needs the data: restore(..., data=recovery.KeyedData(dataset, batch_size))")
        ranks, seen = self.ranks, 0
        for fetched in self.data.shares(self.progress.epoch, self.progress.position, ranks.rank, ranks.world_size):
            if seen == 0:  # a window opens where the last step left the position
                self.window = min(self.data.grad_accum, self.data.batches_per_epoch - self.progress.position)
            seen += 1
            self.window_ends = seen == self.window
            self.weight = fetched.weight / self.window
            self.consumed(fetched.ids, fetched.padded)
            yield fetched.batch
            if self.window_ends:
                seen = 0

    weight: float = 1.0
    """The loss weight of the micro-batch `batches()` handed out last: 1 ÷ its window's
    micro-batches (gradient accumulation), times its share's weight: 1, but for an epoch's
    ragged last batch that the ranks share unevenly (`last_batch="pad"`), world size × this
    rank's samples ÷ the batch's, and 0 for a rank that has none (it trains a repeated sample
    that must add nothing). Multiply the loss by it for the gradient of the whole window."""
    window: int = 1
    """Micro-batches in the window `batches()` is in: what the next `step()` counts."""
    window_ends: bool = True
    """The micro-batch handed out last closes its window: step the optimizer, then `step()`."""

    def consumed(self, ids, padded: bool = False) -> None:
        """The sample ids of the batch the next `step` trains on (`batches()` says so itself);
        `padded`: a repeated sample trained at weight 0, counted apart."""
        self.restored("consumed()")
        self.saves.ledger.consumed(ids, padded)


class RecoveryRun(Reading):
    def __init__(self, config: RunConfig, events: TrainingEvents = TrainingEvents(),
                 closing: Callable[[int, str | None], None] | None = None):
        """`closing(exit status, message)`: told how the attempt ended (a tracker's final status)."""
        self.config, self.events, self.closing = config, events, closing
        self.session: AttemptSession | None = None
        self.ranks: Ranks | None = None
        self.held = contextlib.ExitStack()
        self.state: TrainingState | None = None
        self.data: keyed.KeyedData | None = None
        self.saved_step: int | None = None
        """The step of the newest generation this attempt saved (the final save skips it)."""
        self.stopping: str | None = None
        """A stop signal's generation is saved: why the attempt ends at the next step()."""

    # -- open ---------------------------------------------------------------------------------
    def __enter__(self) -> RecoveryRun:
        self.script_handlers, held = stop_handlers(), self.held.__enter__()
        try:
            launch = LaunchEnvironment.from_environ(os.environ)
            held.enter_context(announced(launch.rank))
            self.ranks = held.enter_context(process_group(launch, resolve_device(self.config.device),
                                                          self.config.background_wait, self.config.peer_wait,
                                                          self.config.data_parallel_backend))
            self.preemption = held.enter_context(PreemptionGuard(self.config.preempt_grace_s))
            if self.config.allow_nondeterministic_ops:  # a later seed_everything keeps it (trainer/compat.py)
                compat.use_deterministic_algorithms(warn_only=True)
            from trainer.run.session import AttemptSession  # the attempt's machinery: at the first open

            self.session = AttemptSession(self.config, self.ranks, self.events)
            held.enter_context(self.session.refusals_recorded())
            self.claim = self.session.claim(held)
        except BaseException as error:
            self.leave(error)
        return self

    # -- restore ------------------------------------------------------------------------------
    def restore(self, model: torch.nn.Module, optimizer, scheduler=None, *, scaler=None,
                data: keyed.KeyedData | UnkeyedData | None = None, extras: dict | None = None,
                shared_extras: dict | None = None, architecture: dict | None = None) -> Progress:
        """Hand over the state and get it back from the newest verified generation, in place
        (a fresh start leaves it as built). `optimizer`/`scheduler`: one, or several by name;
        `extras`: any other objects with state_dict/load_state_dict (a batch fetched before
        the step ended, a best validation loss, a curriculum), each rank's own, restored to
        the same rank (refused at another world size); `shared_extras`: those that are the
        same on every rank (an EMA of a DDP model), stored once, rank 0's copy, and restored at
        any world size;
        `data`: the keyed order (`KeyedData`), whose position is the progress (an `UnkeyedData`
        names who orders the data instead, for `report`: an adapter's framework). Returns where
        to continue (`global_step`, `epoch`, `position` = batches done in that epoch).

        Under torchrun `model` may be wrapped already, in DistributedDataParallel or by
        FSDP2's `fully_shard` (wrap, then build the optimizer, then restore): an FSDP2 model
        is restored shard by shard, each rank reading only its own."""
        if self.state is not None:
            raise UsageError("restore() was called twice on one run; call it once, after building the model")
        if self.session is None or self.closed or self.ended is not None:
            self.misused("restore()")
        import torch.distributed.checkpoint  # noqa: F401  (DCP, 0.7 s once: here, not inside the restore's or the first save's time)

        from trainer.run.restoring import Restorer

        if both := sorted(set(extras or {}) & set(shared_extras or {})):
            raise UsageError(f"restore() got {', '.join(map(repr, both))} both in extras and in shared_extras; "
                             f"name each once")
        self.data, ranks = data, self.ranks
        state = TrainingState(plain_model(model), optimizer, scheduler if scheduler is not None else {},
                              scaler or torch.amp.GradScaler("cpu", enabled=False), rank=ranks.rank,
                              world_size=ranks.world_size, extras=dict(shared_extras or {}),
                              rank_extras=dict(extras or {}), cursors=data.cursors(ranks.world_size) if data else {})
        self.workload = BoundWorkload(OwnLoop({**state.extras, **state.rank_extras}, dict(architecture or {})),
                                      script_files(), "your training script")
        settings = data_parallel_settings(model, self.claim.kept(data.settings() if data else self.config.workload,
                                                                 ranks), ranks)
        config = replace(self.config, workload=settings)
        source = data.source if isinstance(data, keyed.KeyedData) else data if data is not None else UnkeyedData()
        self.saves, checked = self.session.begin(self.claim, self.workload, source,
                                                 self.preemption, config)
        self.parameters, self.state = list(model.parameters()), state  # now the attempt ends by close or failed
        try:
            self.events.attempt_started(self.session.recorder.record)
            if self.claim.generation is not None:
                Restorer(config, self.session.storage, self.session.memory, self.ranks, self.workload).restore(
                    self.claim, self.state, checked.drift, self.saves, self.session.recorder)
            self.session.recorder.reached(self.state.progress.global_step, first=True)
            self.readback = step_readback(self)
            self.readback.vote()  # the first step's decisions, started after the restore
        except BaseException as error:
            self.failed(error)
        return self.state.progress

    @property
    def restoring_step(self) -> int | None:
        """The step of the generation `restore()` will restore (None: a fresh start)."""
        if self.session is None or self.closed:
            self.misused("restoring_step")
        generation = self.claim.generation
        return generation.manifest.step if generation is not None else None

    # -- step ---------------------------------------------------------------------------------
    def step(self, loss) -> bool:
        """After each optimizer step (and scheduler step): the witness's digest, a save when a
        cadence fires, and on a stop signal a save of this step; the next `step()` then
        records that next step's digest without saving it and raises `Stopped` (exit 75), so
        the next attempt's witness replays a step after a stop too (a loop that runs out of steps
        first leaves at the block's end, 75). Returns whether a generation of this step was saved."""
        return self.saved_on_cadence(self.stepped(loss))

    def stepped(self, loss) -> StepAgreement:
        """The first half of `step`: the step counted and witnessed, and what its cadences and
        the stop signals call for (an adapter saves where its framework's save point is). It
        never waits for the device: the step is read after the next one (`StepReadback`)."""
        state = self.restored("step()")
        completed = state.progress.advance(self.window, self.data.batches_per_epoch if self.data else sys.maxsize)
        step = state.progress.global_step
        lr = float(state.optimizers()[0].param_groups[0]["lr"])
        agreed = self.readback.stepped(StepPoint(step, state.progress.epoch, completed), loss, lr)
        if self.stopping is not None:  # the step after a stop signal's save: for the witness, never saved
            raise self.stopped(PREEMPTED, self.stopping)
        self.saves.replicas.after_first_step(state.model, step)  # a forgotten DDP wrap: refused at once
        if step == self.config.interrupt_at_step:
            raise self.stopped(INTERRUPTED, f"interrupt_at_step {step}: stopped without saving")
        if not agreed.acts:
            self.readback.vote()  # nothing saved after this step: the next agreement starts now
        return agreed

    def saved_on_cadence(self, agreed: StepAgreement) -> bool:
        """The second half of `step`: the saves `agreed` calls for; `Stopped` after a stop signal's."""
        state, step = self.state, self.progress.global_step
        self.readback.acting(agreed)
        self.saves.after_step(state, state.model, self.workload, agreed, final=False)
        self.saves.wait_for_staging()  # the loop changes the parameters next: the staged copy must be complete
        if agreed.recover or agreed.preempt:
            self.saved_step = step
        if agreed.preempt:  # the next step() is the witness's and raises `Stopped` (stepped)
            self.stopping = f"{self.preemption.stop_cause} after step {step}; generation saved"
        self.readback.vote()  # after the saves (unless started already)
        return self.saved_step == step

    # -- save ---------------------------------------------------------------------------------
    def save(self) -> None:
        """A recovery generation of the state as it is now (between optimizer steps)."""
        state = self.restored("save()")
        self.readback.flush()  # the generation holds the history through this step
        self.saves.save_generation(state)
        self.saves.wait_for_staging()
        self.saved_step = self.progress.global_step

    # -- close --------------------------------------------------------------------------------
    def close(self) -> Outcome:
        """The run completed: a final generation and export, drained and recorded (exit 0); a
        stop signal's save at its last step ends it as stopped (75), as the trainer's loop."""
        self.readback.finish()
        if self.saved_step != self.progress.global_step:
            self.save()
        self.saves.save_export(self.state, self.state.model, self.workload)
        if self.stopping is not None:
            raise self.stopped(PREEMPTED, self.stopping)
        outcome = self.session.end(COMPLETED, None, self.saves, self.state)
        self.let_go()
        return outcome

    def stopped(self, status: str, reason: str) -> Stopped:
        self.readback.flush(last=True)
        outcome = self.session.end(status, reason, self.saves, self.state, f"{status}: {reason} (exit 75)")
        if self.ranks.is_primary:  # every rank stopped at the same step: rank 0 says so for all
            log.warning("trainer: stopped, resumable (exit %d): %s; to continue, run again with %s",
                        EXIT_INTERRUPTED, outcome.reason, spelled(option("--resume", "auto")))
        self.let_go()
        return Stopped(outcome)

    def failed(self, error: BaseException):
        """Record the failure (a refusal while restoring, or the loop's own exception) and raise it."""
        self.let_go()
        self.session.fail(error, self.claim, self.saves, self.preemption)

    def __exit__(self, kind, error, trace) -> bool:
        try:
            if error is None and self.state is not None:
                try:
                    self.close()
                except Stopped:
                    raise
                except BaseException as raised:  # the final save or export failed: recorded as failed
                    if self.state is None:
                        raise
                    self.failed(raised)
            elif error is not None and not isinstance(error, Stopped) and self.state is not None:
                self.failed(error)
        except BaseException as raised:
            error = raised
        self.leave(error)
        return False

    def leave(self, error: BaseException | None) -> None:
        """Let go of the run directory, the signals and the process group; `error` (if any)
        goes on, a typed trainer error as the command line ends it: one line and its status.
        Under torchrun the ranks that ended together (completed or stopped, 0 or 75) first
        wait for each other, as the trainer's do; the status goes to TRAINER_EXIT_STATUS_FILE
        (torchrun itself exits 1 for any failed rank)."""
        self.closed = True
        try:
            if self.ranks is not None and (error is None or isinstance(error, Stopped)):
                self.ranks.finish()  # no rank leaves while rank 0 still publishes or records
        except BaseException as raised:
            error = raised
        try:
            self.held.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)
        except BaseException as raised:
            error = raised
        if self.ranks is not None and self.ranks.distributed:
            ignore_late_stop_requests()  # the outcome is recorded: a late SIGTERM cannot change it (as run_training)
        else:  # one process: after the block, Ctrl-C and SIGTERM are the script's own again
            restore_stop_handlers(self.script_handlers)
        status, said = exit_status(error)
        report_exit_status(status)
        if self.ranks is not None and self.ranks.distributed:
            exit_without_teardown(status)
        if self.closing is not None:
            self.closing(status, said)
        if isinstance(error, TrainerError):
            rank = self.ranks.rank if self.ranks is not None else 0
            if rank == 0:
                log.error("trainer: error: %s", spelled(error))
            elif not getattr(error, "reported_by_primary", False):
                log.error("trainer: rank %d: error: %s", rank, spelled(error))
            raise SystemExit(error.exit_code) from error
        if error is not None:
            raise error


def step_readback(run: RecoveryRun) -> StepReadback:
    """The run's per-step path (`stepped`): it reads each step after the next one is queued."""
    return StepReadback(run.ranks, run.saves.votes, run.parameters, lambda: run.preemption.requested,
                        lambda read: record_step(run.state, run.session.recorder, run.events, read,
                                                 witness_only=run.stopping is not None),
                        lambda: ahead(run))


def ahead(run: RecoveryRun) -> StepPoint:
    """Where the run's next `step()` will stand (its window as `batches()` will open it)."""
    data = run.data
    window, batches = (data.grad_accum, data.batches_per_epoch) if data else (run.window, sys.maxsize)
    return next_point(run.progress, window, batches)


def exit_status(error: BaseException | None) -> tuple[int, str | None]:
    """The process's exit status after `error` (None: completed), and what to say of it."""
    if error is None:
        return EXIT_OK, None
    if isinstance(error, Stopped):
        return error.outcome.status, error.outcome.reason
    if isinstance(error, TrainerError):
        return error.exit_code, spelled(error)  # a tracker's closing line: options as open_run takes them
    return 1, f"{error.__class__.__name__}: {error}"


def exit_without_teardown(status: int) -> None:
    """At the interpreter's exit, leave as `python -m trainer` leaves one of several processes
    (always that way, the run being distributed, whatever variables are left: Lightning's
    environment deletes WORLD_SIZE at the end of `fit`, so `exit_process` took its one-process
    `sys.exit` there, which an exit handler cannot raise: a traceback on every rank): the exit
    handlers run and the streams are flushed, but not the interpreter's teardown, where torch's
    C++ threads can abort a completed rank (SIGABRT, "terminate called without an active
    exception": seen on a completed 3-rank FSDP2 run of examples/own_loop_ddp.py), which
    torchrun then reports for the whole job. The script's code
    after the `with` block still runs first; if it ends on an uncaught exception, the status is 1."""
    ran = []

    def leaving() -> None:
        if ran:  # leaving runs the other exit handlers, which include this one
            return
        ran.append(True)
        exit_without_interpreter_teardown(1 if getattr(sys, "last_value", None) is not None else status)

    atexit.register(leaving)


def script_files() -> tuple[Path, ...]:
    """The running script, hashed into the fingerprint's `source` (beside the trainer's own)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return (Path(main).resolve(),) if main else ()
