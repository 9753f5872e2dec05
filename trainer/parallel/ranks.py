"""Scale-out under torchrun: the process group, this process's rank, and the few things all
ranks must agree on.

The loop talks to a `Ranks` object and never to `torch.distributed` directly. With one
process (no `WORLD_SIZE`, or `WORLD_SIZE=1`) every method is local and no process group
exists, so a single-process run is byte-for-byte the run it was before scale-out existed.

With several processes, three kinds of agreement keep the ranks in lockstep:
- `decide_on_primary`: rank 0 alone does something with side effects or a verdict (claim
  the output, choose and verify the generation, check the fingerprint, publish) and every
  rank receives its result, or the same error with the same exit status;
- `start_agreement`: one all-reduce per optimizer step, started after the step and its saves
  and read once the next step is queued (never waited for on a step's own path), carries the
  step's loss, rank 0's cadence votes for the next step (its clock is the only one consulted,
  so time triggers cannot make ranks disagree) and whether *any* rank was asked to stop by a
  signal (a signal to any rank stops every rank after the same step). So a step cadence still
  fires at its step, while a time trigger and a signal act one step after they were seen,
  identically on every rank. With one process there is no collective: the votes and the flag
  are taken when the result is read, and only the loss is read a step later;
- `barrier`: every rank has finished its part (its shards are written) before rank 0 acts.

Every collective is entered by every rank in the same order. A collective that fails because
another rank died, or because a rank's heartbeat went silent for `--peer-silence-secs` (its
watcher cuts the gloo groups' connections and aborts an NCCL communicator: parallel/heartbeat.py,
parallel/silence.py; a collective that returns after that is never used), or that
waited past its bound, becomes a one-line `PeerFailure` naming that rank, resumable (75),
instead of a gloo/NCCL traceback or torch's 30-minute wait.

Silence finds a frozen or dead peer; the bound of the training group's collectives
(`--peer-timeout-secs`, auto by default) is the fallback for what silence cannot see (a deadlock
inside a living process). It is the group's own timeout, re-derived after every step's agreement
from what this rank measured between two agreements (`StepPace`): the time a peer may take to
reach the next collective is one such interval, so a rank waits `factor` times a robust slowest
one of the same kind (a step, or a step with a save: the first interval of a kind and a single
outlier never set it), never less than the floor, and torch's own 30 minutes before a kind was
measured (joining, claiming, building, restoring, compiling, the first save); while the run
finishes (draining its uploads) it waits the background groups' bound. A process-group timeout
rather than a watchdog thread: gloo raises it inside whichever collective waits (the step's
agreement, DDP's gradient reduction in backward, a save's barrier), so the error takes the same
way out as a lost connection.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer import compat
from trainer.config import BackgroundWaitConfig, PeerWaitConfig, WorkloadConfig
from trainer.errors import DecidedOnPrimary, PeerFailure, TrainerError, UsageError, is_peer_loss, option, root_cause
from trainer.parallel.heartbeat import Heartbeat, round_prefix
from trainer.parallel.hostcopy import HostCopier, Landed
from trainer.parallel.launch import PRIMARY, LaunchEnvironment, process_age_s
from trainer.parallel.reduction import EXACT, install
from trainer.parallel.silence import GroupSockets, listeners, socket_inodes, waits_of
from trainer.layout import RunDirectory

T = TypeVar("T")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of a rank's global RNGs. Rank 0 keeps `seed` (so one process is seeded as it
    always was); other ranks get decorrelated streams, so their dropout masks and batch noise
    are not copies of rank 0's. The model is still initialized identically everywhere:
    DistributedDataParallel broadcasts rank 0's parameters when it wraps the model, and
    `Ranks.data_parallel` does the same before sharding with FSDP."""
    if rank == PRIMARY:
        return seed
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def outlive_launcher_stop() -> None:
    """Ignore SIGTERM from here to the exit. Once one rank has exited non-zero (75 for an
    interrupted run), torchrun sends SIGTERM to the ranks still running, which at this point
    are only finishing up with the same, already recorded status; dying by the signal would
    make torchrun report -15 for them instead of that status. Preemption is handled earlier,
    by PreemptionGuard during training; a rank stuck here is still killed by torchrun's
    SIGKILL after its grace period."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else error.__class__.__name__


def unshared_output(output: Path, is_primary: bool) -> str | None:
    """Why this rank cannot use the output rank 0 claimed, or None. Every rank writes shards
    into the same temporary generation, so --output must be one shared directory (the same
    path on every node); a rank that cannot see rank 0's lock file would write elsewhere."""
    lock = RunDirectory(output).lock
    if is_primary or lock.is_file():
        return None
    return (f"{lock}, created by rank 0, is not visible here: --output must be on "
            f"storage every rank mounts at the same path")


@dataclass(frozen=True)
class StepAgreement:
    """What every rank does after a step (`Ranks.start_agreement`)."""

    recover: bool
    """Rank 0's recovery cadence fired."""
    export: bool
    """Rank 0's export cadence fired."""
    preempt: bool
    """Some rank received SIGTERM/SIGINT: all ranks save and exit 75 together."""
    memory: bool = False
    """Rank 0's tier-0 cadence fired (`--memory-every-steps`; skipped where a durable save fires)."""

    @property
    def acts(self) -> bool:
        """Something is saved or the attempt stops after the step."""
        return self.recover or self.export or self.preempt or self.memory


def as_loss(loss: torch.Tensor) -> torch.Tensor:
    """A step's loss as one float32 (bf16 and fp16 widen exactly), left where it is."""
    return torch.as_tensor(loss).detach().float().reshape(1)


def votes_tensor(device: torch.device, loss: torch.Tensor | None, flags: torch.Tensor) -> torch.Tensor:
    """[loss, recover, export, stop, memory] on the group's device, with no host wait: what is
    on the host goes to a CUDA group through pinned memory (a pageable copy waits for the
    device). A loss on CUDA with a gloo group (a test's GPU shared by two processes) is copied
    to the host as it is, waiting for it: NCCL is the GPU's group."""
    loss = as_loss(loss).double() if loss is not None else torch.zeros(1, dtype=torch.float64)
    if device.type != "cuda":
        return torch.cat([loss.to(device), flags])
    if loss.device.type == "cpu":
        return torch.cat([loss, flags]).pin_memory().to(device, non_blocking=True)
    return torch.cat([loss.to(device), flags.pin_memory().to(device, non_blocking=True)])


class LocalAgreement:
    """One process: the decisions are taken when asked for (no collective to hide), the loss
    is read from its copy."""

    def __init__(self, votes: Callable[[], tuple[bool, bool, bool]], stop_requested: Callable[[], bool],
                 loss: Landed | None):
        self.votes, self.stop_requested, self._loss = votes, stop_requested, loss

    def loss(self) -> float | None:
        """The loss the agreement carried (None: it carried none)."""
        return self._loss.values()[0] if self._loss is not None else None

    def decisions(self) -> StepAgreement:
        recover, export, memory = self.votes()
        return StepAgreement(recover, export, self.stop_requested(), memory)


class SharedAgreement:
    """Several processes: the all-reduce in flight, waited for (under the group's bound, a
    lost peer named) when first asked for, once the next step is queued."""

    def __init__(self, ranks: "Ranks", summed: Landed, carries_loss: bool):
        self.ranks, self.summed, self.carries_loss = ranks, summed, carries_loss
        self.result: tuple[StepAgreement, float | None] | None = None

    def loss(self) -> float | None:
        return self.read()[1]

    def decisions(self) -> StepAgreement:
        return self.read()[0]

    def read(self) -> tuple[StepAgreement, float | None]:
        if self.result is None:
            ranks = self.ranks
            with ranks._collective("agreeing on the step outcome"):
                loss_sum, recover, export, stop, memory = self.summed.values()
            agreed = StepAgreement(recover > 0, export > 0, stop > 0, memory > 0)
            ranks._bound(ranks._pace.agreed(time.monotonic(), agreed.acts))
            self.result = agreed, loss_sum / ranks.world_size if self.carries_loss else None
        return self.result


PendingAgreement = LocalAgreement | SharedAgreement


class StepPace:
    """The bound of the training group's next wait, from the intervals between agreements.

    An interval is from one step's agreement to the next: the next step's compute and data,
    and whatever the agreement decided to do in between (a save, an export, a tier-0 save),
    which is why an interval after a save is its own kind. Robust to one outlier: the first
    interval of a kind (compiling, warming caches, the first save's allocations) counts only
    until a second is measured, and of the rest the second slowest sets the bound, so a single
    loaded moment never sets it for the rest of the run (a slow interval that repeats does).
    Pure: the clock is passed in."""

    STEP, SAVE = "step", "save"

    def __init__(self, wait: PeerWaitConfig):
        self.wait = wait
        self.first: dict[str, float] = {}
        self.slowest: dict[str, list[float]] = {}
        """Per kind, the two slowest intervals after its first, slowest first."""
        self._last: tuple[float, str] | None = None

    def typical(self, kind: str) -> float | None:
        """The interval a bound of `kind` follows: the second slowest after the first (the only
        one while there is one), the first while nothing else was measured."""
        slowest = self.slowest.get(kind, [])
        return slowest[-1] if slowest else self.first.get(kind)

    def agreed(self, now: float, saves: bool) -> float:
        """An agreement at `now` (monotonic seconds) deciding `saves`: the next wait's bound."""
        if self._last is not None:
            at, kind = self._last
            if kind not in self.first:
                self.first[kind] = now - at
            else:
                self.slowest[kind] = sorted([*self.slowest.get(kind, []), now - at], reverse=True)[:2]
        kind = self.SAVE if saves else self.STEP
        self._last = (now, kind)
        return self.wait.bound_s(self.typical(kind))


class Ranks:
    """This process's place in the run and the collectives the loop needs."""

    def __init__(self, launch: LaunchEnvironment, device: torch.device, group=None,
                 wait: BackgroundWaitConfig = BackgroundWaitConfig(), peer_wait: PeerWaitConfig = PeerWaitConfig(),
                 heartbeat: Heartbeat | None = None):
        self.launch = launch
        self.wait = wait
        """How long the background groups' collectives wait for a peer."""
        self.peer_wait, self.heartbeat = peer_wait, heartbeat
        """How long the training group's collectives wait; who stopped answering when one fails."""
        self._pace = StepPace(peer_wait)
        self._bound_s = peer_wait.bound_s(None)
        self.joined: dict | None = None
        """When this process began joining the group (its age, seconds) and how long joining
        took: the start-up of a restart, split (set by `process_group`)."""
        self._slowest_save_s: float | None = None
        self.sockets: GroupSockets | None = None
        """The connections of this process's gloo groups, cut by the heartbeat's watcher when a
        peer falls silent (`process_group` wires it)."""
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.distributed = launch.distributed
        self.is_primary = launch.is_primary
        self.device = device
        self.copier = HostCopier(device)
        """Brings per-step values to the host without waiting for the device."""
        self.group = group
        """The process group of these collectives: None for the training (default) group."""

    @property
    def backend(self) -> str | None:
        """The backend of these collectives' group (None in one process): the fingerprint's device
        names a backend the device does not use by default (gloo on CUDA)."""
        return dist.get_backend(self.group) if self.distributed and dist.is_initialized() else None

    def background(self) -> "Ranks":
        """The same ranks on a new gloo group, for one background thread (async saves: DCP's
        own collectives, and the commit's agreement). Gloo because DCP's async save needs a
        CPU-capable group and because it reaches every node over TCP, as the training group
        does; a peer that dies shows up there as a reset connection (an error), not a hang.
        A collective: every rank calls it at the same point.

        Its collectives wait `--background-timeout-secs` for a peer (auto: from the saves
        measured, `saved_in`), not torch's 30 minutes: a rank whose staging or writer thread
        failed never enters them, and the others must get to the agreement that names it."""
        if not self.distributed:
            return self
        before = socket_inodes()
        with self._collective("creating the background process group"):
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.wait.bound_s(None)))
        if self.sockets is not None:
            self.sockets.opened(before)  # a silent peer ends these waits too
        background = Ranks(self.launch, torch.device("cpu"), group, self.wait, self.peer_wait, self.heartbeat)
        background.sockets = self.sockets
        return background

    def saved_in(self, seconds: float) -> None:
        """A save this group took part in lasted `seconds`: re-derive its collectives' bound."""
        if self.group is None:
            return
        slowest = max(seconds, self._slowest_save_s or 0.0)
        if self.wait.bound_s(slowest) != self.wait.bound_s(self._slowest_save_s):
            compat.set_group_timeout(self.group, self.wait.bound_s(slowest))
        self._slowest_save_s = slowest

    def data_parallel(self, model: nn.Module, kind: str = WorkloadConfig.data_parallel,
                      reduction: str = WorkloadConfig.gradient_reduction) -> nn.Module:
        """The module to run forward/backward through; build the optimizer on `model` after this.

        ddp: DDP averages gradients across ranks during backward; every rank holds the whole
        model. With an exact `reduction` ("fixed-buckets" or "per-parameter") gradients are
        all-reduced in a layout of their own (trainer/parallel/reduction.py), so the bits do not
        depend on DDP's bucket layout, which changes after the first step. State is still read from and loaded into the plain `model` (DDP shares its
        parameters), so snapshot keys are the same at any world size.

        fsdp: FSDP2 shards `model` in place (each layer with parameters, then the root), so
        every rank holds 1/world_size of each parameter, gradient and optimizer buffer, and
        the whole of one layer only while it runs. Its state dicts hold DTensors, which
        `get_state_dict`/`set_state_dict` and DCP handle: each shard is written once, by
        the rank that holds it, under the same keys and global shapes as an unsharded run.
        """
        if not self.distributed:
            if kind == "fsdp":
                raise UsageError("--data-parallel fsdp needs several processes (torchrun --nproc_per_node N, N > 1)")
            return model
        if kind == "fsdp":
            return self._fully_shard(model)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        if reduction in EXACT:
            install(wrapped, reduction, self.group)
        return wrapped

    def _fully_shard(self, model: nn.Module) -> nn.Module:
        """Unlike DDP, fully_shard does not broadcast: each rank keeps its slice of its *own*
        initialization, and ranks are seeded differently (`rank_seed`). Broadcasting rank 0's
        weights first makes the sharded model the one a single process would have built."""
        from torch.distributed.fsdp import fully_shard  # only FSDP runs pay for importing it

        with self._collective("broadcasting the initial model"), torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=PRIMARY)
        for layer in model.modules():
            if layer is not model and any(True for _ in layer.parameters(recurse=False)):
                fully_shard(layer)
        return fully_shard(model)

    def finish(self) -> None:
        """The run's outcome is decided: wait until every rank got here, so no rank exits
        while rank 0 still publishes or records (torchrun stops the remaining ranks as soon
        as one exits non-zero, 75 included)."""
        if not self.distributed:
            return
        outlive_launcher_stop()
        self.finishing()
        self.barrier("finishing")

    def finishing(self) -> None:
        """The run ends: what is left (draining uploads, the last records) is a save's
        background work, so the training group waits as long as the background groups do
        (`--background-timeout-secs`), and never less than its own bound. A frozen or dead peer
        is found by its silence meanwhile, as in any phase."""
        self._bound(max(self.wait.bound_s(self._slowest_save_s), self._bound_s))

    def _bound(self, seconds: float) -> None:
        if self.distributed and self.group is None and seconds != self._bound_s:
            compat.set_group_timeout(None, seconds)
            self._bound_s = seconds

    def barrier(self, what: str) -> None:
        if not self.distributed:
            return
        with self._collective(what):
            if self.backend == "nccl":
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)

    def decide_on_primary(self, decide: Callable[[], T], what: str) -> T:
        """Run `decide` on rank 0 only and return its result on every rank. If it raises,
        rank 0 re-raises the original error and every other rank raises `DecidedOnPrimary`
        with the same message and exit status (rank 0 alone prints it)."""
        if not self.distributed:
            return decide()
        outcome: list = [None]
        raised: BaseException | None = None
        if self.is_primary:
            try:
                outcome[0] = ("ok", decide())
            except TrainerError as error:
                raised, outcome[0] = error, ("error", str(error), error.exit_code)
            except BaseException as error:
                raised, outcome[0] = error, ("error", f"rank 0 failed while {what}: {_first_line(error)}", 1)
        with self._collective(what):
            dist.broadcast_object_list(outcome, src=PRIMARY, group=self.group)
        if raised is not None:
            raise raised
        kind, *payload = outcome[0]
        if kind == "ok":
            return payload[0]
        message, exit_code = payload
        raise DecidedOnPrimary(message, exit_code)

    def gather(self, value: T, what: str) -> list[T]:
        """Every rank's `value` (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [value]
        gathered: list = [None] * self.world_size
        with self._collective(what):
            dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def require_on_every_rank(self, problem: str | None, what: str) -> None:
        """Every rank states whether it can go on (`problem` is None) or why not; if any
        rank cannot, every rank raises a usage error naming the first such rank (printed by
        rank 0 alone), instead of that rank failing by itself and the others hanging."""
        if not self.distributed:
            if problem:
                raise UsageError(problem)
            return
        problems: list = [None] * self.world_size
        with self._collective(what):
            dist.all_gather_object(problems, problem)
        failing = next(((rank, text) for rank, text in enumerate(problems) if text), None)
        if failing is None:
            return
        message = f"rank {failing[0]}: {failing[1]}"
        if self.is_primary:
            raise UsageError(message)
        raise DecidedOnPrimary(message, UsageError.exit_code)

    def start_agreement(self, loss: torch.Tensor | None, votes: Callable[[], tuple[bool, bool, bool]],
                        stop_requested: Callable[[], bool]) -> PendingAgreement:
        """The agreement on what follows the next step, started (not waited for) after this
        step and its saves: this step's `loss` (None: read already), rank 0's cadence `votes`
        for the next step and each rank's stop flag, summed (see the module's docstring)."""
        if not self.distributed:
            return LocalAgreement(votes, stop_requested, self.copier.copy(as_loss(loss)) if loss is not None else None)
        recover, export, memory = votes() if self.is_primary else (False, False, False)
        flags = torch.tensor([recover, export, stop_requested(), memory], dtype=torch.float64)
        with self._collective("agreeing on the step outcome"):
            summed = votes_tensor(self.device, loss, flags)
            work = dist.all_reduce(summed, group=self.group, async_op=True)
        return SharedAgreement(self, self.copier.copy(summed, work), loss is not None)

    def mean_loss(self, loss: torch.Tensor) -> float:
        """The step's loss over the ranks, read now (a save, a stop, the end: off the per-step
        path), through the same all-reduce as the step's agreement: the same sum to the bit."""
        if not self.distributed:
            return self.copier.copy(as_loss(loss)).values()[0]
        summed = votes_tensor(self.device, loss, torch.zeros(4, dtype=torch.float64))
        with self._collective("reading the step's loss"):
            dist.all_reduce(summed, group=self.group)
            return summed[0].item() / self.world_size

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            if is_peer_loss(error):
                raise self.peer_failure(error, what) from None
            raise
        if self.heartbeat is not None and self.heartbeat.verdict is not None:
            # a peer fell silent and the waits were ended: on NCCL an aborted collective may return
            # without an error, its result unreliable; never go on with it
            raise self.peer_failure(RuntimeError("the process group's waits were ended"), what)

    def peer_failure(self, error: BaseException, what: str) -> PeerFailure:
        """The one line for a collective that failed on a peer, naming the ranks whose heartbeat
        stopped (a verdict already reached, a process of this host that ended, or two readings
        of the counters under a second apart)."""
        timed_out = "timed out" in str(error).lower() or "timeout" in type(error).__name__.lower()
        bound = self._bound_s if self.group is None else self.wait.bound_s(self._slowest_save_s)  # a background group's
        silent = self.heartbeat.silent_ranks() if self.heartbeat is not None else None
        verdict = self.heartbeat.verdict if self.heartbeat is not None else None
        state, said = _what_happened(error, what, silent, verdict, timed_out, bound)
        return PeerFailure(f"{said}; resumable: the next attempt continues from the newest generation "
                           f"(torchrun --max-restarts restarts in place; else {option('--resume', 'auto')})", state, tuple(silent or ()))

    def as_peer_failure(self, error: BaseException, what: str = "training") -> BaseException:
        """`error`, or the PeerFailure it really is: a collective's lost connection or timeout
        raised inside the workload's code (DDP's reduction in backward) is no workload error."""
        if not self.distributed or isinstance(error, TrainerError):
            return error
        cause = root_cause(error)
        if is_peer_loss(cause) or is_peer_loss(error):
            return self.peer_failure(cause, what)
        return error


def _what_happened(error: BaseException, what: str, silent: list[int] | None, verdict: dict | None,
                   timed_out: bool, bound: float) -> tuple[str, str]:
    """A peer failure's state and the first part of its line (`Ranks.peer_failure`)."""
    who = ("rank " if len(silent) == 1 else "ranks ") + ", ".join(map(str, silent)) if silent else None
    one = bool(silent) and len(silent) == 1
    its, is_, was = ("its", "is", "was") if one else ("their", "are", "were")
    heartbeat = "heartbeat" if one else "heartbeats"
    if who and verdict is not None:
        ended = [rank for rank in verdict.get("ended", []) if rank in silent]
        return PeerFailure.UNRESPONSIVE, (
            f"{who} stopped answering: {its} {heartbeat} {was} silent for {verdict['silent_s']:g} s while {what} "
            f"(frozen: a hung device, a silent network, a paused machine; {option('--peer-silence-secs')})"
            + (f"; ended {_processes_of(ended) if not one else 'its process'} on this host (SIGKILL)"
               if ended else ""))
    if timed_out:
        return PeerFailure.UNRESPONSIVE, (
            f"{who} stopped answering: no reply within {bound:g} s while {what}, and {its} {heartbeat} "
            f"stopped (frozen: a hung device, a silent network, a paused machine)") if who else \
            (f"no reply from another rank within {bound:g} s while {what}"
             + (", though every rank's heartbeat goes on (one is slower than the bound allows: "
                f"raise {option('--peer-timeout-secs')})" if silent == [] else ""))
    return PeerFailure.LOST, (
        f"{who} {is_} gone: {its} {'connection' if one else 'connections'} closed while {what} and {its} "
        f"{heartbeat} stopped (the {'process' if one else 'processes'} died or {its} {'node' if one else 'nodes'} "
        f"went away)") if who else \
        f"lost contact with another rank while {what} ({_first_line(error)})"


def _processes_of(ranks: list[int]) -> str:
    return f"the process of rank {ranks[0]}" if len(ranks) == 1 else \
        "the processes of ranks " + ", ".join(map(str, ranks))


def device_of_rank(requested: torch.device, local_rank: int, visible: int) -> torch.device:
    """The CUDA device of the process with `local_rank`, among the `visible` devices it sees: the
    one the launch named (`cuda:N`), else the local rank's own where every process of the node
    sees every GPU, and the same rank modulo what it sees where a launcher gave each process its
    own (per-rank CUDA_VISIBLE_DEVICES: one visible device, `cuda:0`, whatever the local rank)."""
    if requested.index is not None:
        return requested
    return torch.device("cuda", local_rank % max(1, visible))


def backend_for(device: torch.device, asked: str) -> str:
    """The process group's backend (`--data-parallel-backend`): NCCL on CUDA and gloo on the CPU
    unless another was asked for; NCCL without CUDA is a usage error."""
    if asked == "nccl" and device.type != "cuda":
        raise UsageError(f"{option('--data-parallel-backend', 'nccl')} needs CUDA, and this run trains on "
                         f"{device.type}; use {option('--data-parallel-backend', 'gloo')} or "
                         f"{option('--device', 'cuda')}")
    if asked == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return asked


@contextmanager
def process_group(launch: LaunchEnvironment, device: torch.device,
                  wait: BackgroundWaitConfig = BackgroundWaitConfig(),
                  peer_wait: PeerWaitConfig = PeerWaitConfig(), backend: str = "auto") -> Iterator[Ranks]:
    """Join the run's process group (`backend`: auto is gloo on CPU, NCCL on CUDA; one device
    per local rank) from the variables torchrun or the training operator set; leave it on the
    way out.

    An error escaping a multi-process run that is really a peer's disappearance (including
    one DCP wrapped, or one raised inside DDP's backward) is reported as a `PeerFailure`.

    A group the process already joined (a user's script or a framework called
    `init_process_group` before `recovery.open_run`) is used as it is and left to its owner:
    not joined again, not destroyed on the way out; its timeout becomes the training group's
    bound (`--peer-timeout-secs`), as ours would. Its sockets were opened before this rank
    looked: they are found as the connections to and from every rank's gloo listener (gathered
    over the group once, `GroupSockets.adopt`), so a silent peer is cut off as in our own group.
    """
    backend = backend_for(device, backend)
    if not launch.distributed:
        yield Ranks(launch, device, wait=wait, peer_wait=peer_wait)
        return
    if device.type == "cuda":
        device = device_of_rank(device, launch.local_rank, torch.cuda.device_count())
        torch.cuda.set_device(device)
    began, age = time.monotonic(), process_age_s()
    owned = not dist.is_initialized()
    before = socket_inodes()
    if owned:
        join(launch, backend, peer_wait.join_bound_s(launch.restart))
    if not owned or peer_wait.join_bound_s(launch.restart) != peer_wait.bound_s(None):
        compat.set_group_timeout(None, peer_wait.bound_s(None))  # joined: the collectives' own bound from here
    heartbeat = Heartbeat(launch, peer_wait.silence_s).start()
    ranks = Ranks(launch, device, wait=wait, peer_wait=peer_wait, heartbeat=heartbeat)
    ranks.sockets = GroupSockets(launch.master_port)
    if dist.get_backend() == "gloo" and owned:
        ranks.sockets.opened(before)  # gloo's; NCCL's connections are its own (docs/scale-out.md, On NCCL)
    elif dist.get_backend() == "gloo":
        ranks.sockets.adopt(ranks.gather(listeners(launch.master_port), "finding the process group's connections"))
    # the main thread leaves its wait with "connection closed" (gloo), or finds the verdict after it (NCCL)
    heartbeat.on_silence = waits_of(dist.get_backend(), ranks.sockets, compat.DeviceCommunicator()).cut
    ranks.joined = {"at_s": age, "join_s": round(time.monotonic() - began, 3)}
    ended = False  # marked as left: ended by itself (completed, stopped, or a survivor naming a loss)
    lost = False
    """A peer is gone: the group is not destroyed, which would wait for the step's agreement still
    in flight with it (an async all-reduce, `start_agreement`) until the silence watcher cuts it."""
    try:
        yield ranks
        ended = True
    except PeerFailure:
        ended = lost = True  # a survivor that named the loss: no rank reading after it exited may name it lost too
        raise
    except TrainerError:
        raise
    except BaseException as error:
        cause = root_cause(error)
        if is_peer_loss(cause):
            ended = lost = True
            raise ranks.peer_failure(cause, "training") from None
        raise
    finally:
        heartbeat.stop(left=ended)
        outlive_launcher_stop()
        if owned and not lost:
            dist.destroy_process_group()


NCCL_ERROR_HANDLING = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
"""How an NCCL group ends a wait that failed (torch 2.13's meanings; verified on a GPU only):
blocking wait: the waiting thread itself raises a collective past the group's bound, or one the
silence watcher aborted (parallel/silence.py `CommunicatorAbort`), as an error, which becomes the
PeerFailure (75); no asynchronous handling by NCCL's watchdog (torch's default, 3, ends the
process by SIGABRT at the timeout: no line, no record; torch's own abort asks for it off, and
blocking wait turns it off anyway)."""


def join(launch: LaunchEnvironment, backend: str, timeout_s: float) -> None:
    """Join the process group, on a thread of its own so this one stays responsive: a
    SIGTERM (the agent stopping a round whose peer died while joining) is handled at once
    instead of after the join's timeout, beyond the agent's grace.

    Under torchrun's agent the store outlives a restart of the workers, and the group's keys
    in it are the same every round: a restarted worker read the dead round's addresses and
    failed to connect ("Connection refused"), so the first restart never rejoined. The group
    gets a prefix per round (`round_prefix`) in that case."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        for name, value in NCCL_ERROR_HANDLING.items():
            os.environ.setdefault(name, value)  # read when the group is created; the user's own choice stands
    if launch.agent_store:
        store = dist.PrefixStore(round_prefix(launch), dist.TCPStore(
            launch.master_addr, launch.master_port, launch.world_size, is_master=False, timeout=timeout))
        arguments = {"store": store}
    else:
        arguments = {"init_method": "env://"}
    failure: list[BaseException] = []

    def joining() -> None:
        try:
            dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout,
                                    **arguments)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            failure.append(error)

    thread = threading.Thread(target=joining, name="trainer-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if failure:
        error = failure[0]
        if launch.restart and any(word in str(error).lower() for word in ("timed out", "timeout")):
            raise PeerFailure(f"round {launch.restart} of torchrun's restarts: not every rank of the "
                              f"{launch.world_size} joined within {timeout_s:g} s ({option('--rejoin-timeout-secs')}); a node "
                              f"whose agent did not restart its workers (a frozen worker under a static rendezvous) "
                              f"never comes; resumable: {option('--resume', 'auto')} continues when every node starts again"
                              ) from None
        if isinstance(error, (RuntimeError, ValueError)):
            raise PeerFailure(f"could not join the {launch.world_size}-process group as rank {launch.rank} "
                              f"({_first_line(error)}); check MASTER_ADDR/MASTER_PORT and that every rank "
                              f"started") from None
        raise error
