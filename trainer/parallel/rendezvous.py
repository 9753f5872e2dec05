"""`env://` and `tcp://` keyed by torchrun's restart round, so a process group a script or its
framework creates itself (`init_process_group()`, HF's `TrainingArguments`, `Accelerator()`,
Lightning under torchrun) rejoins in a restarted round.

Under torchrun's c10d rendezvous the agent hosts ONE store for the whole launch and hands it to
every round (`TORCHELASTIC_USE_AGENT_STORE=True`; torch 2.13's dynamic rendezvous keeps its
`_bootstrap_store_info`), and torch's `env://` and `tcp://` connect to it without a per-round
prefix (`_create_c10d_store`: its comment "a new TCPStore for every retry" no longer holds).
`init_process_group` then writes and reads the same keys every round (`default_pg/0/...`): in a
restarted round a rank may read a dead worker's address before its successor overwrote it and
fail to connect (gloo: "Connection refused", or a connect timeout), so rejoining is a race that
a rank starting a little later than another loses (measured: docs/scale-out.md).

`key_by_round` wraps torch's two handlers in place: from the first restart on (round 0 is
torch's own, unchanged) the store they yield is a `PrefixStore` of the round
(`round_prefix(...)/env`), so each round's group meets only its own keys. Nothing changes outside
torchrun's agent store. The trainer's own `join` keys its group by round already
(`parallel/ranks.py`); this is for groups created by others: `trainer.recovery` and the launch
entry (`trainer.launch`) install it, before the script can create a group.
"""

from __future__ import annotations

import os

from trainer import compat
from trainer.errors import UsageError
from trainer.parallel.heartbeat import round_prefix
from trainer.parallel.launch import LaunchEnvironment

SCHEMES = ("env", "tcp")
"""The init methods that reach the agent's store under torchrun (`file://` does not)."""
KEYED = "_trainer_keyed_by_round"
"""Marks a handler already wrapped (a second install changes nothing)."""


def round_store_prefix(env) -> str | None:
    """The prefix of this round's keys in the agent's store; None where torch's keys are safe
    (no agent store, or its first round)."""
    try:
        launch = LaunchEnvironment.from_environ(env)
    except UsageError:
        return None  # torch's own handler says what is missing
    if not (launch.agent_store and launch.restart > 0):
        return None
    return f"{round_prefix(launch)}/env"


def key_by_round() -> None:
    """Wrap torch's `env://` and `tcp://` handlers (idempotent; read at every rendezvous, so a
    worker the warm spare forked uses its own round)."""
    handlers = compat.RENDEZVOUS_HANDLERS.resolve()
    for scheme in SCHEMES:
        original = handlers.get(scheme)
        if original is not None and not getattr(original, KEYED, False):
            handlers[scheme] = _keyed(original)


def _keyed(original):
    def handler(url, **kwargs):
        prefix = round_store_prefix(os.environ)
        for store, rank, world_size in original(url, **kwargs):
            if prefix is not None:
                import torch.distributed as dist

                store = dist.PrefixStore(prefix, store)
            yield store, rank, world_size

    setattr(handler, KEYED, True)
    handler.__wrapped__ = original
    return handler


def install_under_torchrun(env) -> None:
    """`key_by_round` where it matters (torchrun's agent store): importing the library elsewhere
    leaves torch untouched."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        key_by_round()
