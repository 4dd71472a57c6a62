"""Megatron tensor parallelism that turns on sequence parallelism when the case sets ``sp``
(Korthikanti et al. 2022), built on the native Megatron layers as a user extending them
would. Under SP each tp rank's LayerNorms see only its slice of the sequence, so their
gradients are partial sums that must be all-reduced over tp (Megatron-LM's
``allreduce_sequence_parallel_grads``). ``SPUnreducedNorms`` reduces the row-parallel biases
and the position embedding but forgets the LayerNorms -- invisible with ``sp=false``
(Megatron-LM, NeMo and PaddlePaddle trackers carry reports of this kind)."""
from impls.tensor.collectives import all_reduce_flat
from impls.tensor.megatron import Megatron1D, megatron_prediction


class OptionalSP(Megatron1D):
    name = ""
    options = ("sp", "recompute")

    def __init__(self, ctx):
        self.sp = ctx.options.tensor.sp  # read before the model is built
        super().__init__(ctx)

    @classmethod
    def check(cls, case):
        super(Megatron1D, cls).check(case)  # Megatron1D's own check refuses sp

    @classmethod
    def predict(cls, case):
        """Megatron's closed form for this case's sp (the class attribute is the 1D one)."""
        return megatron_prediction(case, case.options.tensor.sp)

    def partial_grads(self):
        """The parameters whose gradients are partial under SP."""
        return self.model.sequence_parallel_params()

    def after_backward(self):
        if self.sp and self.tp > 1:
            all_reduce_flat([p.grad for p in self.partial_grads()], self.group)


class SPUnreducedNorms(OptionalSP):
    def partial_grads(self):
        # the bug: the LayerNorms' weights and biases are left out of the reduction
        return [self.model.p(n) for n, pl in self.model.placements.items()
                if pl.replicated and ".ln" not in n and not n.startswith("head.ln")]
