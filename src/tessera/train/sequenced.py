"""``boost`` under ``Plan(sp > 1)``: a transformers causal LM trained with its sequence
split over the ``sp`` axis (``tessera.parallel.sequence.SequenceParallel``: Ring or Ulysses
attention through transformers' attention interface).

Every sp rank holds the whole model and sees a slice of every sequence, so the ZeRO core
shards and averages over all dp x sp ranks (as DeepSpeed-Ulysses does). The loss a rank
back-propagates is the global mean loss times sp: the engine's average over dp x sp then
sums the slices' gradients over sp and averages them over dp, which is the gradient of
the global batch's mean loss.
"""

from __future__ import annotations

from tessera.parallel.sequence import SequenceParallel
from tessera.train.boosted import BoostedOptimizer
from tessera.train.losses import SequenceLoss


class SequenceParallelOptimizer(BoostedOptimizer):
    """``BoostedOptimizer`` whose micro-batches run sequence-parallel; ``sp_mesh`` is the
    (dp, sp) mesh, ``mesh`` the engine's flat dp x sp one."""

    def __init__(self, *args, sp_mesh, **kwargs):
        super().__init__(*args, **kwargs)
        self.sp_mesh = sp_mesh
        self.sequence = SequenceParallel(self.model, sp_mesh.comm, "sp", self.plan.sp_method)

    def batch_split(self) -> tuple[int, int, str, int]:
        """This dp replica's share of the global batch; its sp ranks take the same share."""
        return self.sp_mesh.size("dp"), self.sp_mesh.rank("dp"), "grad_accum", self.plan.grad_accum

    def data_parallel_size(self) -> int:
        return self.sp_mesh.size("dp")  # the engine's flat axis is dp x sp; sp ranks share rows

    def micro_loss(self, loss_fn, micro_batch, denominator=None):
        if not isinstance(loss_fn, SequenceLoss):
            raise ValueError(
                f"Plan(sp={self.plan.sp}) splits each sequence over ranks, so the loss must know how: "
                f"{loss_fn!r} has no sequence_parallel method (use tessera.train.losses.causal_lm_loss)"
            )
        if denominator is None:
            loss = loss_fn.sequence_parallel(self.sequence, micro_batch)
        else:
            loss = loss_fn.sequence_parallel(self.sequence, micro_batch, denominator=denominator)
        return loss, loss * self.sp_mesh.size("sp")
