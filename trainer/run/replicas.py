"""The model's replicas, compared across ranks: under torchrun a model that is not sharded is
one model held by every rank, and a generation keeps rank 0's copy of it for all. A script
that forgets to wrap its model in DistributedDataParallel (or a framework that does not
synchronise the ranks) trains one model per rank, and every rank's work but rank 0's would
be thrown away without a word; a resume would then not be the uninterrupted run. So the
parameters' checksums are compared after an attempt's first step and at every save (where
the state digests are gathered anyway), and ranks that differ are refused before anything
of theirs is committed. Only parameters: buffers (BatchNorm's running statistics without
SyncBatchNorm), RNGs and data positions differ per rank by design; an FSDP2 model is sharded
(nothing to compare), and so is any DTensor parameter (tensor parallelism).
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from trainer.errors import DecidedOnPrimary, UsageError
from trainer.parallel.ranks import Ranks
from trainer.run.checksum import replica_checksum, safe_state_digests


class Replicas:
    """One attempt's comparisons (`CadencedSaves.replicas`): none with one process or a sharded model."""

    def __init__(self, ranks: Ranks, sharded: bool):
        self.ranks, self.compared, self.first_checked = ranks, ranks.distributed and not sharded, False

    def after_first_step(self, model: nn.Module, step: int) -> None:
        """Once an attempt, after its first step (a user's loop): one gather of 8 bytes a rank."""
        if self.compared and not self.first_checked:
            self.first_checked = True
            refuse_unequal(self.ranks, self.ranks.gather(replica_digest(model), "comparing the model's replicas"), step)

    def state_digests(self, state_dict: dict, model: nn.Module, step: int, beside=None) -> tuple[list[dict], list]:
        """Every rank's state digests, in rank order, for a generation's manifest, and every
        rank's `beside` (the sample ledger): the parameters' checksums ride on the same gather,
        one collective a save, and are compared before anything is written."""
        gathered = self.ranks.gather((safe_state_digests(state_dict), replica_digest(model) if self.compared else 0,
                                      beside), "gathering the state digests and the sample ledger")
        if self.compared:
            refuse_unequal(self.ranks, [replica for _, replica, _ in gathered], step)
        return [digests for digests, _, _ in gathered], [given for _, _, given in gathered]


def replica_digest(model: nn.Module) -> int:
    """This rank's checksum of the model's replicated parameters (DTensors left out)."""
    return replica_checksum([parameter for parameter in model.parameters() if not hasattr(parameter, "to_local")])


def refuse_unequal(ranks: Ranks, digests: Sequence[int], step: int) -> None:
    """Every rank raises the same usage error (rank 0 alone prints it) when some rank's
    parameters differ from rank 0's: every rank holds `digests`, so every rank stops here."""
    differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if not differing:
        return
    named = ", ".join(map(str, differing))
    message = (f"the model differs between ranks after step {step}: rank{'s' if len(differing) > 1 else ''} "
               f"{named} hold{'' if len(differing) > 1 else 's'} other parameters than rank 0, so each rank trains "
               f"a model of its own and a generation would keep rank 0's alone (nothing of this step is saved); "
               f"wrap the model in DistributedDataParallel (or shard it with fully_shard) inside the `with` block, "
               f"before building the optimizer and calling restore(), or all-reduce its gradients yourself "
               f"before each optimizer step")
    if ranks.is_primary:
        raise UsageError(message)
    raise DecidedOnPrimary(message, UsageError.exit_code)
