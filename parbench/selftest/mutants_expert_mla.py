"""A realistic bug of the expert family on multi-head latent attention (DeepSeek-V2, arXiv
2405.04434, Sec. 2.1.2-2.1.3; DeepSeek-V3, arXiv 2412.19437, Sec. 2.1.1), the dense part of
``deepseek-v3-tiny`` at ep = dp = 2: the latent projections and norms (``q_down``,
``q_norm``, ``q_up``, ``kv_down``, ``kv_norm``, ``kv_up``) left out of the dense gradients'
all-reduce over dp -- a dense bucket collected by the multi-head attention's parameter names
(``qkv``, ``proj``) -- while every dense gradient is still divided by dp: each rank steps on
its own half of the batch's latent gradients."""
from __future__ import annotations

from impls.expert.scheme import ExpertAllToAll

from .catalogue import mutant

#: the preset and its expert count (the family's case sets num_experts=4)
DEEPSEEK_V3 = {"model": "deepseek-v3-tiny", "num_experts": "8"}

#: the MLA parameters a bucket of multi-head attention's names misses
LATENTS = (".attn.q_down.", ".attn.q_norm.", ".attn.q_up.", ".attn.kv_down.",
           ".attn.kv_norm.", ".attn.kv_up.")


@mutant("mla-latents-not-reduced", base="expert.alltoall", overrides=DEEPSEEK_V3,
        bug="MLA's latent projections and norms left out of the dense all-reduce over dp "
            "(a bucket of the MHA names): each rank keeps its own latent gradients / dp")
class MLALatentsNotReduced(ExpertAllToAll):
    def reduce_dense_gradients(self):
        latent = [p for n, p in self.model.named_parameters()
                  if any(k in n for k in LATENTS)]
        local = [p.grad.clone() for p in latent]
        super().reduce_dense_gradients()
        for p, g in zip(latent, local):
            p.grad.copy_(g / self.dp)  # the bug: divided by dp, never summed over it
