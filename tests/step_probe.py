"""What a step of either loop waits on, recorded in the process that trains (tests/test_step_path.py).

Training is cut into windows: a window opens where a step's first forward is about to run
(`window()`: the trainer's `OptimizerSteps.open_window`, a script's loop top) and lasts until
the next one opens, so step N's forward, backward, optimizer step and everything the loop does
after it (its readback, its saves) fall in window N. A TorchFunctionMode stamps every tensor a
torch function returns with the window it was made in, and records each host read (`.item()`,
`.tolist()`, `.cpu()`, `float()`, ...) that trainer code (the direct caller) makes of a tensor
made in the same window: a value the step produced, read on the step's own path. Collectives
that trainer code calls are recorded as blocking (no `async_op`) or, for an async one, by the
window that waits for it. The report goes to `STEP_PROBE_OUT.<rank>.json`, rewritten at every
window (a rank of several may leave without running exit handlers).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

TRAINER = str(Path(__file__).resolve().parents[1] / "trainer")
DATA = TRAINER + "/data/"
RANKS, ATOMIC = TRAINER + "/parallel/ranks.py", TRAINER + "/checkpoint/coordination.py"
TORCH = str(Path(torch.__file__).resolve().parent)
HERE = str(Path(__file__).resolve())
READS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"}
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "barrier",
               "gather_object", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def trainer_caller() -> str | None:
    """The innermost caller outside torch and this probe, `file:line`, if it is the trainer's code."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == HERE):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(TRAINER) or \
            frame.f_code.co_filename.startswith(DATA):  # sample ids: host tensors, never on the device
        return None
    caller = frame
    while caller.f_back is not None and caller.f_code.co_filename in (RANKS, ATOMIC):  # who asked for it
        caller = caller.f_back
    return f"{caller.f_code.co_filename[len(TRAINER) - len('trainer'):]}:{caller.f_lineno}"


def storage_of(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class Probe(TorchFunctionMode):
    def __init__(self, out: str):
        super().__init__()
        self.out, self.current = out, 0
        self.report = {"windows": 0, "reads": [], "blocking": [], "waits": []}

    def window(self) -> None:
        self.current += 1
        self.report["windows"] = self.current
        Path(f"{self.out}.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(self.report))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and args and isinstance(args[0], torch.Tensor) and \
                getattr(args[0], "_probe_window", None) == self.current and (caller := trainer_caller()):
            self.report["reads"].append([self.current, name, caller])
        result = func(*args, **(kwargs or {}))
        inputs = [arg for arg in (*args, *(kwargs or {}).values()) if isinstance(arg, torch.Tensor)]
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, torch.Tensor):
                try:
                    tensor._probe_window = self.made_in(name, tensor, inputs)
                except (AttributeError, RuntimeError):
                    pass
        return result

    def made_in(self, name: str, tensor: torch.Tensor, inputs: list) -> int:
        """The window whose values `tensor` holds: this one for new values or an in-place
        change; a view's (or a no-op conversion's) input's for the same values seen anew."""
        if name.endswith("_") and not name.endswith("__"):
            return self.current
        storage = storage_of(tensor)
        for given in inputs:
            if given is tensor or (storage is not None and storage == storage_of(given)):
                return getattr(given, "_probe_window", self.current)
        return self.current

    def collective(self, name: str, call):
        probe = self

        def recorded(*args, **kwargs):
            trainer = trainer_caller()
            work = call(*args, **kwargs)
            if trainer and not kwargs.get("async_op"):
                probe.report["blocking"].append([probe.current, name, trainer])
            return Waited(work, probe, probe.current, name) if trainer and kwargs.get("async_op") else work
        return recorded


class Waited:
    """An async collective's work: which window waits for it."""

    def __init__(self, work, probe: Probe, started: int, name: str):
        self._work, self._probe, self._started, self._name = work, probe, started, name

    def wait(self, *args, **kwargs):
        self._probe.report["waits"].append([self._started, self._probe.current, self._name])
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def install(out: str) -> Probe:
    """The probe, on for the rest of the process; the trainer's windows open in `open_window`."""
    from trainer.run.stepping import OptimizerSteps

    probe = Probe(out)
    probe.__enter__()
    for name in COLLECTIVES:
        setattr(dist, name, probe.collective(name, getattr(dist, name)))
    opened = OptimizerSteps.open_window

    def open_window(self, size):
        probe.window()
        return opened(self, size)
    OptimizerSteps.open_window = open_window
    return probe
