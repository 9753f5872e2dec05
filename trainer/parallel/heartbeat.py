"""Who stopped answering, and when: a heartbeat per rank in the rendezvous store, watched by
every other rank.

Each rank bumps a counter of its own in the rendezvous store (the one torchrun's agent hosts, or
rank 0's) every `interval_s`, on a thread of its own, and registers who it is (host, boot, pid,
start time: parallel/silence.py). Every rank also watches the others' counters on a second
thread: a counter that has not moved for `silence_s` (`--peer-silence-secs`) is a frozen (SIGSTOP,
a paused VM, a hung device holding the process) or dead peer, whatever the step time (each rank
watches the next `WATCHED` ranks and reads the posted verdict: every rank is watched). The
watcher then posts the verdict in the store (so every rank names the same culprit), ends the
frozen worker if it is provably on this host (so torchrun does not wait its 30 s grace), and
cuts this process's group connections, so the main thread leaves whatever collective it waits
in with the usual error and one line. A slow rank (a long step, a long save, a loaded machine)
keeps beating, because the beat runs on its own thread, and is never named; a rank whose main
thread is stuck in a collective keeps beating too, so it is never blamed for waiting on the
culprit.

What makes a living rank's beat late is what keeps its thread from running: a call that holds
the GIL (the beat needs it between requests), a fork of a large process, a swap storm, a store
request stuck in a loaded store. docs/scale-out.md has the measured gaps; the default bound is
well above them.

The store is reached through clients of our own with a short timeout: a store that went away
with its host (rank 0, when no agent hosts it) is an answer in itself. Nothing here is needed
for training: if the store cannot be reached the heartbeat is off and a failure names no rank.
A read that fails is no evidence: a peer is judged only on readings that succeeded. Keys live
under a prefix per round of the agent's restarts (`round_prefix`), so a restarted round never
reads a counter of the round before.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Callable

from trainer.parallel.launch import PRIMARY, LaunchEnvironment
from trainer.parallel.silence import ProcessIdentity, end_if_here, is_dead_here

log = logging.getLogger("trainer")

STORE_TIMEOUT_S = 3.0
"""How long one store request may take before the store counts as gone."""
WATCHED = 8
"""Peers each rank watches: the next ones in rank order (a ring), so every rank is watched by
this many others and the store's load grows with the world size, not its square; the verdict
is posted, so every rank learns of it at its next reading."""
LEFT = 1 << 40
"""Added to a rank's counter when it leaves on purpose (the run ended): never judged silent."""


def round_prefix(launch: LaunchEnvironment) -> str:
    """This round's keys in a store that outlives the workers (torchrun's agent store): the
    agent restarts every worker of a node together, so the restart count names the round."""
    return f"trainer/round-{launch.restart}"


class Heartbeat:
    def __init__(self, launch: LaunchEnvironment, silence_s: float | None = None, interval_s: float = 0.3,
                 window_s: float = 0.9):
        self.launch, self.interval_s, self.window_s = launch, interval_s, window_s
        self.silence_s = silence_s
        """A peer silent this long is frozen or dead (None: only named after a failure)."""
        self.identity = ProcessIdentity.of_this_process()
        self.verdict: dict | None = None
        """{"ranks": [...], "silent_s": S, "ended": [...]}: the peers found silent, once found."""
        self.on_silence: Callable[[], None] = lambda: None
        """Called once, on the watcher's thread, after a verdict (parallel/ranks.py ends the groups'
        waits: parallel/silence.py `waits_of`)."""
        self.longest_gap_s = 0.0
        """The longest this rank's own beat was late (what the bound must stay above)."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._peers: dict[int, ProcessIdentity | None] = {}

    def _client(self):
        import torch.distributed as dist

        store = dist.TCPStore(self.launch.master_addr, self.launch.master_port, is_master=False,
                              timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        return dist.PrefixStore(f"{round_prefix(self.launch)}/heartbeat", store)

    def start(self) -> "Heartbeat":
        try:
            beats = self._client()
            if self.identity is not None:
                beats.set(f"who/{self.launch.rank}", json.dumps(self.identity.as_dict()))
            beats.add(str(self.launch.rank), 1)
            watched = self._client()
        except Exception as error:  # noqa: BLE001 - the heartbeat only names culprits; training goes on
            log.warning("no heartbeat (the rendezvous store at %s:%s: %s): a lost peer will not be named",
                        self.launch.master_addr, self.launch.master_port, error)
            return self
        self._threads.append(threading.Thread(target=self._beat, args=(beats,), name="trainer-heartbeat", daemon=True))
        if self.silence_s is not None:
            self._threads.append(threading.Thread(target=self._watch, args=(watched,), name="trainer-peer-watch",
                                                  daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    @property
    def on(self) -> bool:
        return bool(self._threads)

    def _beat(self, beats) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                beats.add(str(self.launch.rank), 1)
            except Exception:  # noqa: BLE001 - a slow or lost store: try again; never stop beating for good
                try:
                    beats = self._client()  # a client whose connection broke does not come back by itself
                except Exception:  # noqa: BLE001
                    pass
                continue
            now = time.monotonic()
            self.longest_gap_s, last = max(self.longest_gap_s, now - last), now  # as the watchers see it

    def stop(self, left: bool = True) -> None:
        """Stop beating and watching; `left`: the others are told this rank ended on purpose."""
        self._stop.set()
        if left and self.on:
            try:
                self._client().add(str(self.launch.rank), LEFT)
            except Exception:  # noqa: BLE001 - the others' runs are over too, or the store is gone
                pass

    def others(self) -> list[int]:
        return [rank for rank in range(self.launch.world_size) if rank != self.launch.rank]

    def watched(self) -> list[int]:
        size = self.launch.world_size
        return [(self.launch.rank + step) % size for step in range(1, min(size - 1, WATCHED) + 1)]

    def _watch(self, beats) -> None:
        """Every interval, read each peer's counter; a counter unchanged since a reading
        `silence_s` ago means the peer beat no more since then (readings that fail are skipped)."""
        moved: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(self.interval_s):
            try:
                if self.verdict is None and (posted := self.posted_verdict(beats)) is not None:
                    self._judged(posted, beats)
                    return
                counts = {rank: beats.add(str(rank), 0) for rank in self.watched()}
            except Exception:  # noqa: BLE001 - no reading is no evidence
                continue
            now = time.monotonic()
            for rank, count in counts.items():
                if rank not in moved or moved[rank][0] != count:
                    moved[rank] = (count, now)
            silent = [rank for rank, (count, at) in moved.items()  # 0: its heartbeat never started (off)
                      if 0 < count < LEFT and now - at >= self.silence_s]
            if silent:
                self._judged({"ranks": sorted(silent), "silent_s": round(max(now - moved[r][1] for r in silent), 1),
                              "by": self.launch.rank}, beats)
                return

    def _judged(self, verdict: dict, beats) -> None:
        """Post the verdict, end the silent workers on this host, then let the ranks act."""
        if verdict.get("by") == self.launch.rank:
            try:  # the first verdict posted stands for everyone's naming
                beats.compare_set("verdict", "", json.dumps(verdict))
            except Exception:  # noqa: BLE001 - the line still names them, on this rank
                pass
        verdict["ended"] = [rank for rank in verdict["ranks"] if self._end(rank, beats)]
        self.verdict = verdict
        self.on_silence()

    def _end(self, rank: int, beats) -> bool:
        peer = self._identity_of(rank, beats)
        return peer is not None and end_if_here(peer, self.identity)

    def _identity_of(self, rank: int, beats=None) -> ProcessIdentity | None:
        if self._peers.get(rank) is None:
            try:
                beats = beats or self._client()
                if beats.check([f"who/{rank}"]):
                    self._peers[rank] = ProcessIdentity(**json.loads(beats.get(f"who/{rank}")))
            except Exception:  # noqa: BLE001 - not registered (no /proc there), or the store is gone
                return None
        return self._peers.get(rank)

    @staticmethod
    def posted_verdict(beats) -> dict | None:
        if not beats.check(["verdict"]):
            return None
        return json.loads(beats.get("verdict"))

    def silent_ranks(self) -> list[int] | None:
        """The other ranks known to be frozen or gone, in order; None when it cannot be known
        (no heartbeat). A verdict already reached (here or posted by another rank) stands; else a
        peer of this host whose process has ended is named at once (no second reading); else the
        counters are read twice, `window_s` apart. A store that stopped answering names its
        host, rank 0."""
        if not self.on:
            return None
        if self.verdict is not None:
            return list(self.verdict["ranks"])
        try:
            beats = self._client()
            posted = self.posted_verdict(beats)
            if posted is not None:
                self.verdict = posted
                return list(posted["ranks"])
            before = {rank: beats.add(str(rank), 0) for rank in self.others()}
            dead = [rank for rank in self.others() if before[rank] < LEFT
                    and (peer := self._identity_of(rank, beats)) is not None and is_dead_here(peer, self.identity)]
            if dead:
                return dead
            time.sleep(self.window_s)
            after = {rank: beats.add(str(rank), 0) for rank in self.others()}
        except Exception:  # noqa: BLE001 - the store is gone: without torchrun's agent, rank 0 hosted it
            return None if self.launch.agent_store else [PRIMARY]
        return [rank for rank in self.others() if after[rank] == before[rank] and after[rank] < LEFT]
