"""DistFlashAttn (Li, Shao, Xie, Xing, Ma, Stoica, Gonzalez, Zhang 2023, "DISTFLASHATTN:
Distributed Memory-efficient Attention for Long-context LLMs Training", arXiv 2310.03294) as
the context-parallel scheme ``context.distflashattn``:

1. contiguous sequence chunks with the load-balanced causal schedule of Sec. 3.1
   (``distflash_plan``): idle workers compute the busy workers' queries against their own
   K/V and send back the partial output and log-sum-exp;
2. point-to-point messages of the next step posted before the current block's kernel and
   waited after it (Sec. 3.2; ``distflash_attn``);
3. ``recompute=full`` is rematerialization-aware checkpointing (Sec. 3.3;
   ``distflash_remat``): the checkpoint boundary at the attention output, so backward does
   not run the distributed attention forward again. ``selective`` is the naive alternative
   (the attention core checkpointed at its inputs, its forward and messages repeated).

Measured for the row beside ``analytic.context_distflash``: each worker's block computations
per attention forward and attention-kernel CPU time, the attention forwards per step, and
the bytes a layer keeps for backward.
"""
from __future__ import annotations

import torch.distributed as dist

from parbench import comm
from parbench.analytic import context_distflash as closed
from parbench.analytic import shape_from
from parbench.analytic.context import cp_block_keywords, cp_layer_activation_bytes, imbalance
from parbench.config import CaseConfig, ConfigError
from parbench.memory import SavedActivations
from parbench.scheme import Prediction, register

from .base import ContextParallelScheme
from .distflash_attn import DistFlashCore, DistFlashPeers
from .distflash_plan import BalancedSchedule
from .distflash_remat import remat_shard_forward
from .layout import positions


@register
class DistFlashAttnScheme(ContextParallelScheme):
    """Li et al. 2023: balanced causal schedule, overlapped p2p, remat-aware checkpoints."""

    name = "context.distflashattn"
    kind = "distflashattn"
    options = ("recompute",)
    description = ("DistFlashAttn (Li et al. 2023): load-balanced causal attention, "
                   "overlapped p2p, rematerialization-aware checkpointing")
    peers_class = DistFlashPeers
    schedule_class = BalancedSchedule
    core_class = DistFlashCore
    #: every block, helped ones included, masked by the documents' ids (``distflash_attn``)
    supports_packing = True
    #: the LLaMA blocks (RoPE at the chunks' global positions, in the remat path too:
    #: ``distflash_remat.qkv``); multi-head attention only (its kernels move every head)
    model_features = ContextParallelScheme.MHA_FEATURES

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        m = case.model
        if m.num_kv_heads and m.num_kv_heads != m.num_heads:
            raise ConfigError(f"num_kv_heads={m.num_kv_heads}: {cls.name} runs multi-head "
                              "attention (num_kv_heads = num_heads)")

    def build_core(self):
        group = self.ctx.mesh.group("cp") if self.cp > 1 else None
        return self.core_class(self.peers_class(group, self.clock, self.schedule_class))

    def token_positions(self):
        return positions(self.ctx.model.seq_length, self.cp, self.cp_rank)

    def bind_documents(self, docs):
        self.core.peers.docs = docs

    def forward(self, tokens, targets, pos, measure: bool = False):
        if self.ctx.options.recompute != "full":
            return super().forward(tokens, targets, pos, measure)
        saved = SavedActivations(exclude=self.params) if measure else None
        loss = remat_shard_forward(self.model, tokens, pos, targets, self.core, saved,
                                   self.embed, self.loss_fn(), self.docs, self.taps)
        if measure:
            self._activation_bytes = saved.bytes
            led = comm.active()
            if led is not None:
                self._fwd_cp_bytes = sum(v for a, v in led.wire_by_axis().items()
                                         if a.startswith("cp"))
        return loss

    # ---- closed forms -------------------------------------------------------------------------
    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        p, mdl = case.layout, case.model
        shape = shape_from(mdl)
        b = p.micro_batch_size
        ranks = closed.rank_predictions(shape, cp=p.cp, dp=p.dp, micro_batch_size=b,
                                        num_microbatches=p.num_microbatches,
                                        recompute=case.options.recompute,
                                        optimizer=case.run.optimizer)
        if case.options.recompute == "full":
            act = closed.remat_layer_activation_bytes(mdl.seq_length, b, mdl.hidden_size,
                                                      mdl.num_heads, p.cp)
        else:
            act = cp_layer_activation_bytes(
                "ring-attention", mdl.seq_length, b, mdl.hidden_size, mdl.num_heads, p.cp,
                case.options.recompute, mdl.ffn,
                blocks=cp_block_keywords(mdl, mdl.seq_length // p.cp, b))
        work = cls.predicted_work(case)
        naive = closed.rank_predictions(shape, cp=p.cp, dp=1, micro_batch_size=b,
                                        num_microbatches=p.num_microbatches, recompute="selective")
        figures = {"activation_bytes_per_layer": act,
                   "attention_work_per_rank": work,
                   "attention_imbalance": imbalance(work),
                   "attention_blocks_per_cp_rank": closed.blocks_per_worker(p.cp),
                   "unbalanced_blocks_per_cp_rank": closed.unbalanced_blocks(p.cp),
                   "idle_fraction": closed.idle_fraction(p.cp),
                   "idle_fraction_unbalanced": closed.idle_fraction(p.cp, balanced=False),
                   "attention_forwards_per_step": mdl.num_layers * p.num_microbatches
                   * (2 if case.options.recompute == "selective" else 1),
                   "cp_bytes_per_cp_rank_naive_recompute": [r.wire_bytes.get("cp", 0.0)
                                                            for r in naive],
                   "transfers": [r.figures["transfers"] for r in ranks]}
        return Prediction(wire_bytes=[r.wire_bytes for r in ranks],
                          model_state_bytes=[r.states for r in ranks],
                          calls=[r.calls for r in ranks], figures=figures)

    @classmethod
    def predicted_work(cls, case: CaseConfig) -> list[int]:
        return closed.work_per_worker(case.model.seq_length, case.layout.cp)

    # ---- measurements -----------------------------------------------------------------------
    def metrics(self) -> dict:
        out = super().metrics()
        pe = self.core.peers
        steps = max(1, len(self.clock.per_step))
        mine = (pe.blocks / max(1, pe.forwards), pe.forwards / steps)
        every = [None] * dist.get_world_size()
        with comm.unrecorded():
            dist.all_gather_object(every, mine)
        layout = self.ctx.mesh.layout
        per_cp = [next(e for r, e in enumerate(every) if layout.coords(r)["cp"] == c)
                  for c in range(self.cp)]
        pred = self.predict(self.ctx.case).figures
        out.update({
            "attention_blocks_per_cp_rank": " / ".join(f"{b:g}" for b, _ in per_cp),
            "attention_blocks_per_cp_rank_predicted": " / ".join(
                str(b) for b in pred["attention_blocks_per_cp_rank"]),
            "unbalanced_blocks_per_cp_rank": " / ".join(
                str(b) for b in pred["unbalanced_blocks_per_cp_rank"]),
            "idle_fraction_predicted": pred["idle_fraction"],
            "idle_fraction_unbalanced": pred["idle_fraction_unbalanced"],
            "attention_forwards_per_step": per_cp[0][1],
            "attention_forwards_per_step_predicted": pred["attention_forwards_per_step"],
            "cp_bytes_naive_recompute_predicted": " / ".join(
                f"{b:g}" for b in pred["cp_bytes_per_cp_rank_naive_recompute"])})
        return out
