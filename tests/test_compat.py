"""Every private API we use still exists in the installed versions: an upgrade that moves one
fails here, naming it, instead of deep inside a save or a restore."""

from __future__ import annotations

import pytest
import torch

from support.cli import REPO
from support.limits import scaled
from trainer import compat


@pytest.mark.parametrize("private", compat.PRIVATE_NAMES, ids=lambda p: f"{p.module}.{p.name}")
def test_private_name_resolves(private):
    assert private.resolve() is not None


def test_a_moved_name_fails_with_one_line_naming_it_and_the_checked_version():
    moved = compat.PrivateName("torch.distributed.checkpoint.filesystem", "_NoSuchThing", "torch", "2.13.0",
                               "a test")
    with pytest.raises(compat.PrivateApiMoved) as raised:
        moved.resolve()
    message = str(raised.value)
    assert "_NoSuchThing is gone" in message and "checked against 2.13.0" in message
    assert "trainer/compat.py" in message and "\n" not in message


def test_the_wrappers_do_what_the_writer_and_restore_rely_on():
    assert compat.element_size(torch.float16) == 2
    info = compat.storage_info("__0_0.distcp", 7, 11)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 7, 11)
    flat = compat.flatten_state_dict({"model": {"w": torch.zeros(2)}, "step": 3})
    assert set(flat) == {"model.w", "step"}


def test_a_process_groups_backend_can_be_had_to_abort_it():
    import torch.distributed as dist

    assert callable(getattr(dist.ProcessGroup, compat.GROUP_BACKEND))


def test_the_schedulers_last_lr_can_be_set():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    compat.set_scheduler_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]


def test_optimizer_state_is_materialised_without_moving_the_parameters():
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([parameter], lr=0.1, weight_decay=0.5)
    compat.init_optimizer_state(optimizer)
    assert set(optimizer.state[parameter]) == {"step", "exp_avg", "exp_avg_sq"}
    assert torch.equal(parameter.detach(), torch.ones(3)) and parameter.grad is None
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_deterministic_algorithms_are_on_without_importing_inductor():
    """The flag torch.use_deterministic_algorithms(True) sets, and inductor's own flag when a
    workload compiles later, without paying inductor's import at every start."""
    import subprocess
    import sys

    probe = ("import sys, torch\n"
             "from trainer import compat\n"
             "compat.use_deterministic_algorithms()\n"
             "assert torch.are_deterministic_algorithms_enabled()\n"
             "assert 'torch._inductor.config' not in sys.modules\n"
             "import torch._inductor.config as inductor\n"
             "assert inductor.deterministic is True\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=scaled(300))
    assert result.returncode == 0, result.stderr[-2000:]


# ----------------------------------------------------------------------------- the .metadata allowlist
def test_the_metadata_allowlist_is_pinned_to_the_installed_torch():
    """trainer/checkpoint/allowlist.py names private DCP classes too: each still exists, the
    dtype names are exactly torch's, and the version checked is the one installed. Upgrading
    torch fails here first, naming what to re-check."""
    import importlib

    from trainer.checkpoint import allowlist

    for module, name in sorted(allowlist.METADATA_GLOBALS):
        assert getattr(importlib.import_module(module), name, None) is not None, f"{module}.{name} is gone"
    assert allowlist.TORCH_DTYPES == {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
    assert torch.__version__.split("+")[0] == allowlist.CHECKED_TORCH, "re-check the allowlist for this torch"


def test_a_real_metadata_names_only_allowlisted_globals(tmp_path):
    """What DCP of this torch pickles into `.metadata` for every kind of entry the trainer
    stores (tensors of several dtypes, bytes values, nested containers) stays inside the
    allowlist, and reads back equal through it."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import allowlist
    from trainer.checkpoint.safe_load import read_metadata

    state = {"w": torch.zeros(3, dtype=torch.bfloat16), "n": torch.arange(4), "b": torch.ones(2, dtype=torch.bool),
             "lr": 0.1, "betas": (0.9, 0.99), "name": "x", "none": None, "list": [1, 2.0]}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Recording(__import__("io").BytesIO(data)).load()
    assert all(allowlist.allowed(module, name) for module, name in seen), sorted(seen)
    assert allowlist.metadata_problem(data) is None
    assert read_metadata(tmp_path).state_dict_metadata.keys() == dcp.FileSystemReader(
        str(tmp_path)).read_metadata().state_dict_metadata.keys()
