"""The uploader's threading and the lease's policy, without a server: against an in-memory
implementation of our own object-client interface (tests/memory_objects.py). The real
server's behaviour is covered end to end in test_store.py and test_store_pods.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from support.limits import scaled, wait_until
from memory_objects import MemoryObjects
from trainer.checkpoint.checkpointer import SyncCheckpointer
from trainer.checkpoint.commit import RenameCommit
from trainer.checkpoint.manifest import GenerationFacts
from trainer.checkpoint.section import LocalSection
from trainer.errors import OutputLocked, TrainerError
from trainer.layout import GENERATIONS, MANIFEST, RunDirectory, generation_name
from trainer.storage.object.lease import LEASE, TOKEN, Holder, LeaseLost, StoreLease
from trainer.storage.object.tiering import RemoteRun, StoreRetention, Uploader

NO_RETENTION = StoreRetention(None, None, None)


@pytest.fixture
def tier(tmp_path):
    """A local tier with a checkpointer that publishes tiny real generations."""
    run = RunDirectory(tmp_path / "tier")
    run.checkpoints.mkdir(parents=True)
    checkpointer = SyncCheckpointer(RenameCommit(LocalSection(run.checkpoints)), "attempt")

    def publish(step: int):
        facts = GenerationFacts(step, 0, step, {"source": "s"}, (), {}, "2026-12-01T00:00:00Z")
        return checkpointer.save({"w": torch.full((4,), float(step))}, facts)[0]
    return run, publish


def uploader_for(objects, run, max_pending=2):
    return Uploader(RemoteRun(objects, run), max_pending, lambda: None, NO_RETENTION, frozenset())


def test_uploads_commit_in_publish_order_and_drain_at_the_end(tier):
    run, publish = tier
    objects = MemoryObjects()
    uploader = uploader_for(objects, run)
    names = []
    for step in (1, 2, 3):
        published = publish(step)
        names.append(published.name)
        uploader.submit(GENERATIONS, published.name, run.checkpoints / published.name, time.monotonic())
    durable = uploader.drain()
    uploader.close()
    assert [done.name for done in durable] == names
    manifests = [key for key in objects.objects if key.endswith(MANIFEST)]
    assert manifests == [f"checkpoints/{name}/{MANIFEST}" for name in names]  # dicts keep insertion order
    assert uploader.not_durable(GENERATIONS) == set() and uploader.newest_durable(GENERATIONS) == names[-1]
    assert all(done.bytes > 0 and done.durable_s >= done.upload_s >= 0 for done in durable)


def test_back_pressure_holds_the_save_beyond_the_bound(tier):
    run, publish = tier
    objects = MemoryObjects()
    objects.upload_gate.clear()  # a store that does not finish anything yet
    uploader = uploader_for(objects, run, max_pending=2)
    for step in (1, 2):
        published = publish(step)
        assert uploader.submit(GENERATIONS, published.name, run.checkpoints / published.name, 0.0) < 1.0
    third = publish(3)
    waited = []
    blocked = threading.Thread(target=lambda: waited.append(
        uploader.submit(GENERATIONS, third.name, run.checkpoints / third.name, 0.0)))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a third save went ahead with two uploads still pending"
    assert len(uploader.not_durable(GENERATIONS)) == 2
    objects.upload_gate.set()
    blocked.join(scaled(30))
    assert waited and waited[0] >= 0.25
    assert [done.name for done in uploader.drain()] == [generation_name(step) for step in (1, 2, 3)]
    uploader.close()


def test_a_drain_with_a_deadline_leaves_a_hanging_upload_pending(tier):
    """A preemption drains within its grace: a hanging upload does not hold the exit."""
    run, publish = tier
    objects = MemoryObjects()
    objects.upload_gate.clear()
    uploader = uploader_for(objects, run)
    published = publish(1)
    uploader.submit(GENERATIONS, published.name, run.checkpoints / published.name, 0.0)
    started = time.monotonic()
    assert uploader.drain(timeout_s=0.2) == []
    assert 0.2 <= time.monotonic() - started < scaled(5)  # returned at its deadline, not when the upload ends
    assert uploader.not_durable(GENERATIONS) == {published.name}
    objects.upload_gate.set()
    assert [done.name for done in uploader.drain()] == [published.name]
    uploader.close()


def test_a_failed_upload_surfaces_at_the_next_save(tier):
    run, publish = tier
    objects = MemoryObjects()
    objects.fail_uploads = True
    uploader = uploader_for(objects, run)
    first = publish(1)
    uploader.submit(GENERATIONS, first.name, run.checkpoints / first.name, 0.0)
    wait_until(lambda: uploader.failed, "the upload to fail", every=0.01)
    second = publish(2)
    with pytest.raises(TrainerError) as failed:
        uploader.submit(GENERATIONS, second.name, run.checkpoints / second.name, 0.0)
    assert failed.value.exit_code == 74 and "\n" not in str(failed.value) and "uploading" in str(failed.value)
    assert not any(key.endswith(MANIFEST) for key in objects.objects), "nothing may be committed half"
    uploader.close()


# ----------------------------------------------------------------------------- the lease
def foreign_holder(ttl_s: float) -> bytes:
    return Holder("old-attempt", "another-host", 12345, ttl_s).encode(0)


def test_a_silent_holder_is_taken_over_after_one_ttl_on_the_watchers_clock():
    objects = MemoryObjects()
    objects.write_conditionally(LEASE, foreign_holder(0.6), None)  # its renewed_utc says nothing to us
    started = time.monotonic()
    with StoreLease(objects, "new-attempt", ttl_s=5.0, wait_s=10.0) as lease:
        waited = time.monotonic() - started
        assert Holder.parse(objects.read(LEASE)).attempt == "new-attempt"
        lease.fence()
    assert waited >= 0.6, f"took over after {waited:.2f}s, before one ttl of the holder passed"
    released = Holder.parse(objects.read(LEASE))
    assert (released.attempt, released.released) == ("new-attempt", True), "a released lease is a tombstone"


def test_a_renewed_lease_is_not_taken_over_and_the_second_trainer_gets_73():
    objects = MemoryObjects()
    with StoreLease(objects, "holder", ttl_s=0.6, wait_s=None):
        with pytest.raises(OutputLocked) as refused:
            StoreLease(objects, "second", ttl_s=0.6, wait_s=1.5).acquire()
        assert refused.value.exit_code == 73 and "attempt holder" in str(refused.value)
        assert Holder.parse(objects.read(LEASE)).attempt == "holder"


def test_the_fence_refuses_once_another_attempt_took_over():
    objects = MemoryObjects()
    lease = StoreLease(objects, "zombie", ttl_s=30.0, wait_s=0.0).acquire()
    lease.fence()
    objects.write(LEASE, Holder("successor", "elsewhere", 1, 30.0).encode(0))
    with pytest.raises(LeaseLost) as lost:
        lease.fence()
    assert lost.value.exit_code == 73 and "successor" in str(lost.value)
    lease.release()
    assert Holder.parse(objects.read(LEASE)).attempt == "successor", "a zombie's release deletes nothing"


def test_a_write_whose_response_was_lost_is_adopted_and_a_deleted_lease_taken_again():
    objects = MemoryObjects()
    objects.lose_next_response = True
    lease = StoreLease(objects, "mine", ttl_s=30.0, wait_s=0.0).acquire()
    assert Holder.parse(objects.read(LEASE)).attempt == "mine"
    lease.fence()  # the ETag it adopted is the object's
    objects.delete([LEASE])  # an operator or a lifecycle rule
    lease.fence()
    assert Holder.parse(objects.read(LEASE)).attempt == "mine"
    lease.release()


def test_a_zombie_that_wakes_after_its_successor_released_the_lease_is_still_fenced():
    """The successor took the lease over, finished and released it; the zombie's fence must
    not mistake the released lease for a free one (were it deleted, the zombie would take it
    again and commit over the successor's line). A new trainer takes a released lease at once."""
    objects = MemoryObjects()
    zombie = StoreLease(objects, "zombie", ttl_s=30.0, wait_s=0.0).acquire()
    zombie._stop.set()  # paused: no more renewals
    objects.write_conditionally(LEASE, foreign_holder(30.0), objects.etag(LEASE)[1])  # a takeover...
    objects.write_conditionally(LEASE, Holder("old-attempt", "another-host", 12345, 30.0).encode(1, released=True),
                                objects.etag(LEASE)[1])  # ...then a release by the attempt that took it over
    with pytest.raises(LeaseLost, match="lost the lease .*released: that attempt ended"):
        zombie.fence()
    started = time.monotonic()
    with StoreLease(objects, "next", ttl_s=30.0, wait_s=10.0):
        assert time.monotonic() - started < 1.0, "a released lease is taken at once"
        assert Holder.parse(objects.read(LEASE)).attempt == "next"


def test_a_zombie_is_fenced_even_when_its_successors_tombstone_was_deleted():
    """The successor took over (the fencing token moved on), ended and released the lease;
    then an operator or a lifecycle rule deleted the tombstone. The zombie finds no lease, but
    the token says another attempt held it since: refused (73), nothing taken back. Each new
    holder gets a larger token."""
    objects = MemoryObjects()
    zombie = StoreLease(objects, "zombie", ttl_s=0.6, wait_s=0.0).acquire()
    zombie._stop.set()  # paused: no more renewals
    assert objects.read(TOKEN) == b"1"
    with StoreLease(objects, "successor", ttl_s=30.0, wait_s=10.0):  # takes over once the zombie's ttl passed
        assert objects.read(TOKEN) == b"2"
    objects.delete([LEASE])
    with pytest.raises(LeaseLost, match="was deleted and its fencing token moved on to 2 .ours: 1."):
        zombie.fence()
    assert objects.read(LEASE) is None, "the zombie took nothing back"
    objects.delete([TOKEN])  # whatever is deleted: with the token gone too, it still cannot tell
    with pytest.raises(LeaseLost):
        zombie.fence()
    assert objects.read(LEASE) is None


def test_a_deleted_lease_and_token_refuse_a_live_holder_rather_than_guess():
    objects = MemoryObjects()
    lease = StoreLease(objects, "mine", ttl_s=30.0, wait_s=0.0).acquire()
    objects.delete([LEASE, TOKEN])
    with pytest.raises(LeaseLost, match="was deleted and its fencing token too") as lost:
        lease.fence()
    assert lost.value.exit_code == 73
    lease.release()
