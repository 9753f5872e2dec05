"""Who stopped answering: a heartbeat per rank in the rendezvous store.

A collective that fails says only that *some* peer did not come: gloo names an address, a
timeout names nobody. So each rank bumps a counter of its own in the rendezvous store (the one
torchrun's agent hosts, or rank 0's) every `interval_s`, on a thread of its own. After a
failure a rank reads every counter twice, `window_s` apart: a rank whose counter did not move
is frozen (SIGSTOP, a paused VM), dead, or cut off from the store. A slow rank (a long save, a
slow step) keeps beating and is not named; a rank whose main thread is stuck in a collective
keeps beating too, so it is never blamed for waiting on the culprit.

The store is reached through clients of our own with a short timeout: a store that went away
with its host (rank 0, when no agent hosts it) is an answer in itself. Nothing here is needed
for training: if the store cannot be reached the heartbeat is off and a failure names no rank.
Keys live under a prefix per round of the agent's restarts (`round_prefix`), so a restarted
round never reads a counter of the round before.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from trainer.parallel.launch import PRIMARY, LaunchEnvironment

log = logging.getLogger("trainer")

STORE_TIMEOUT_S = 3.0
"""How long one store request may take before the store counts as gone."""


def round_prefix(launch: LaunchEnvironment) -> str:
    """This round's keys in a store that outlives the workers (torchrun's agent store): the
    agent restarts every worker of a node together, so the restart count names the round."""
    return f"trainer/round-{launch.restart}"


class Heartbeat:
    def __init__(self, launch: LaunchEnvironment, interval_s: float = 0.3, window_s: float = 0.9):
        self.launch, self.interval_s, self.window_s = launch, interval_s, window_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _client(self):
        import torch.distributed as dist

        store = dist.TCPStore(self.launch.master_addr, self.launch.master_port, is_master=False,
                              timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        return dist.PrefixStore(f"{round_prefix(self.launch)}/heartbeat", store)

    def start(self) -> "Heartbeat":
        try:
            beats = self._client()
            beats.add(str(self.launch.rank), 1)
        except Exception as error:  # noqa: BLE001 - the heartbeat only names culprits; training goes on
            log.warning("no heartbeat (the rendezvous store at %s:%s: %s): a lost peer will not be named",
                        self.launch.master_addr, self.launch.master_port, error)
            return self
        self._thread = threading.Thread(target=self._beat, args=(beats,), name="trainer-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self, beats) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                beats.add(str(self.launch.rank), 1)
            except Exception:  # noqa: BLE001 - a store gone away; the others will see this rank as silent
                return

    def stop(self) -> None:
        self._stop.set()

    def silent_ranks(self) -> list[int] | None:
        """The other ranks whose heartbeat did not move over `window_s`, in order; None when it
        cannot be known (no heartbeat). A store that stopped answering names its host, rank 0."""
        if self._thread is None:
            return None
        others = [rank for rank in range(self.launch.world_size) if rank != self.launch.rank]
        try:
            beats = self._client()
            before = {rank: beats.add(str(rank), 0) for rank in others}
            time.sleep(self.window_s)
            after = {rank: beats.add(str(rank), 0) for rank in others}
        except Exception:  # noqa: BLE001 - the store is gone: without torchrun's agent, rank 0 hosted it
            return None if self.launch.agent_store else [PRIMARY]
        return [rank for rank in others if after[rank] == before[rank]]
