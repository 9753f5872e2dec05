"""A process group the script creates itself rejoins in a restarted round (trainer/parallel/
rendezvous.py, docs/scale-out.md "Rejoining"): real torchrun, gloo, kill -9 of rank 1, the
agent's restart, a round-1 rank that starts its join after the other (tests/rejoin_probe.py).
Without the keying torch's `env://` hands rank 0 the dead worker's address in that order, and
round 1 fails to connect. Cost (TEST_CPU_LOG): about 9 CPU-s (one torchrun, four interpreters
importing torch; the unit tests nothing)."""

from __future__ import annotations

import os

from support.cli import completed
from support.torchrun import clean_environment, launch
from support.limits import scaled

import torch.distributed as dist

from trainer import compat
from trainer.parallel.rendezvous import key_by_round, round_store_prefix

PROBE = os.path.join(os.path.dirname(__file__), "rejoin_probe.py")


def test_a_scripts_own_group_rejoins_in_a_restarted_round_whichever_rank_starts_first(tmp_path):
    env = clean_environment(PROBE_KEYED="1", PROBE_MARK=str(tmp_path / "mark"),
                            PROBE_TIMEOUT_S=str(scaled(20)))
    result = completed(launch(["--standalone", "--nproc_per_node", "2", "--max-restarts", "1", PROBE], env), 300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"round 1 rank {rank} joined (2)" in result.stdout, result.stdout + result.stderr[-3000:]


def test_only_a_restarted_round_under_the_agents_store_is_keyed():
    agent = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
             "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert round_store_prefix({**agent, "TORCHELASTIC_RESTART_COUNT": "2"}) == "trainer/round-2/env"
    assert round_store_prefix({**agent, "TORCHELASTIC_RESTART_COUNT": "0"}) is None  # torch's own keys: fresh
    assert round_store_prefix({**agent, "TORCHELASTIC_USE_AGENT_STORE": "False",
                               "TORCHELASTIC_RESTART_COUNT": "1"}) is None  # rank 0 hosts a new store each round
    assert round_store_prefix({"WORLD_SIZE": "2"}) is None  # torch's handler names what is missing


def test_keying_twice_wraps_once():
    handlers = compat.RENDEZVOUS_HANDLERS.resolve()
    key_by_round()
    wrapped = dict(handlers)
    key_by_round()
    assert handlers == wrapped and handlers["env"].__wrapped__.__name__ == "_env_rendezvous_handler"
    assert dist.rendezvous  # the public entry is torch's, unchanged
