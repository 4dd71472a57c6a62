"""``tensor.megatron`` (Shoeybi et al. 2019) and ``tensor.megatron-sp`` (Korthikanti et al.
2022): the model is :class:`megatron_model.MegatronGPT`; predictions come from
``parbench.analytic.tensor`` (closed forms) and activation memory per layer is measured beside
``parbench.analytic.activations.reference_layer_activation_bytes``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench import comm
from parbench.analytic import shape_from
from parbench.analytic import tensor as tensor_model
from parbench.analytic.activations import (korthikanti_layer_bytes, reference_block_keywords,
                                          reference_layer_activation_bytes)
from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.probes import ModuleProbe, microbatch_rows
from parbench.scheme import Prediction, register

from .base import TensorParallelScheme
from .collectives import all_reduce_flat
from .megatron_model import MegatronGPT


def megatron_prediction(case: CaseConfig, sp: bool) -> Prediction:
    m, p = case.model, case.layout
    shape = shape_from(m)
    tp = p.tp
    transfers = tensor_model.megatron_step_traffic(
        shape, p.micro_batch_size, tp, p.num_microbatches, case.options.recompute, sp,
        clip_grad=case.run.clip_grad)
    wire, calls = tensor_model.per_rank(transfers, tp)
    states = tensor_model.model_states(tensor_model.megatron_params(shape, tp),
                                       case.run.optimizer)
    return Prediction(
        wire_bytes=wire, calls=calls, model_state_bytes=[dict(states) for _ in range(tp)],
        figures={"padded_vocab": tensor_model.padded_vocab(m.vocab_size, tp),
                 "transfers": [t.as_dict() for t in transfers],
                 "paper": tensor_model.megatron_paper_traffic(
                     shape, p.micro_batch_size, tp, p.num_microbatches, case.options.recompute,
                     sp)})


def activation_figures(case: CaseConfig, sp: bool) -> dict:
    """Korthikanti et al.'s per-layer activation bytes adapted to the reference model
    (``reference_layer_activation_bytes``), for this case's tp / sp / recompute and LLaMA
    blocks (``reference_block_keywords`` at this tp: RoPE and the K/V repeat run inside the
    recomputed core, ``attention_core``, as the default ``rope_recomputed`` says)."""
    m, p = case.model, case.layout
    sp = sp and p.tp > 1
    return {"act_layer_formula": reference_layer_activation_bytes(
        m.seq_length, p.micro_batch_size, m.hidden_size, m.num_heads, p.tp, sp,
        case.options.recompute, m.ffn, bytes_per_element=4, proj_input_copy=False,
        **reference_block_keywords(m, p.tp, p.micro_batch_size)),
        # Table 2 verbatim: 16-bit activations, 1-byte dropout masks, f = 4h, eager softmax
        "act_layer_korthikanti": korthikanti_layer_bytes(
            m.seq_length, p.micro_batch_size, m.hidden_size, m.num_heads, p.tp, sp,
            case.options.recompute)}


class MegatronFigures(TensorParallelScheme):
    """The closed forms of a Megatron 1D / SP case (``sp``): ours and the baselines of the
    same layers (DTensor, Megatron-Core) share them."""

    sp = False

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        return megatron_prediction(case, cls.sp)

    def activation_formula(self) -> dict:
        return activation_figures(self.ctx.case, self.sp)


@register
class Megatron1D(MegatronFigures):
    name = "tensor.megatron"
    description = ("Megatron 1D: column/row-parallel linears, conjugate f/g, vocab-parallel "
                   "embedding and cross-entropy (padded vocabulary)")
    options = ("recompute",)
    sp = False
    model_cls = MegatronGPT
    #: clips by global norm (``TensorParallelScheme.clip``): shards summed over tp, the
    #: tp-replicated parameters counted on tp rank 0 only
    supports_clip_grad = True
    #: a masked loss: the vocab-parallel cross-entropy's mean over the counted tokens
    #: (``MegatronGPT.token_mean``), scaled by their share of the global count
    #: (``TensorParallelScheme.loss_scale``; Megatron-LM's --calculate-per-token-loss)
    supports_loss_mask = True
    #: packed documents: every rank holds whole samples and finds their documents in the
    #: tokens (``MegatronGPT.forward``; Megatron's --reset-attention-mask / -position-ids)
    supports_packing = True
    #: the LLaMA blocks: RoPE on the rank's heads, GQA with the query groups split over tp
    #: (t | num_kv_heads) or, t > num_kv_heads, the QKV output gathered (``gqa``), SwiGLU's
    #: [gate; up] sharded half by half, RMSNorm, no biases and multi-head latent attention
    #: (``megatron_mla``; not under selective recomputation)
    model_features = MODEL_FEATURES | {"mla"}

    def build_model(self):
        ctx = self.ctx
        return self.model_cls(ctx.model, ctx.run.seed, self.group, self.tp, self.tp_rank,
                           sp=self.sp, recompute=ctx.options.recompute).to(ctx.device)

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        if case.options.tensor.sp and not cls.sp:
            raise ConfigError(f"sp=true is scheme tensor.megatron-sp, not {cls.name}")
        g, t = case.model.num_kv_heads, case.layout.tp
        if g and g % t and t % g:
            raise ConfigError(f"tp={t} and num_kv_heads={g}: one must divide the other "
                              f"({cls.name} splits the query groups over tp, or with t > g "
                              "gathers the QKV output as Megatron-Core does)")
        if case.model.kv_lora_rank and case.options.recompute == "selective":
            raise ConfigError(f"recompute=selective with kv_lora_rank={case.model.kv_lora_rank}"
                              f": {cls.name} recomputes no MLA core (use none or full)")

    def module_probes(self):
        """The reference modules as probe points of the model (``MegatronGPT.tap``;
        issue 20, sec. 5): every tp rank holds the whole global batch, a micro-batch's rows
        per call; the embedding, the norms, the attention and MLP after their row-parallel
        reduction and the head's input are whole on every rank (``g``: all-reduce) or, under
        sp, the rank's sequence shard (``g-bar``: reduce-scatter) -- sequence-first, either
        way. The loss is the global batch's mean token loss, so the input gradients are the
        golden run's (``grad_scale`` 1)."""
        lay, s = self.ctx.layout, self.ctx.model.seq_length
        rows = microbatch_rows(0, lay.micro_batch_size * lay.num_microbatches,
                               lay.num_microbatches)
        seq = slice(None)
        if self.model.sp:
            n = s // self.tp
            seq = slice(self.tp_rank * n, (self.tp_rank + 1) * n)
        return [ModuleProbe(name, tap, [(r, seq) for r in rows], sequence_first=True)
                for name, tap in self.model.probe_points().items()]

    def metrics(self) -> dict:
        """Plus the largest difference between this rank's gradient of a tp-replicated
        parameter (LayerNorms, row-parallel biases, position embedding) and tp rank 0's:
        0.0 when they are identical, as Megatron 1D relies on (checked outside the ledger)."""
        out = super().metrics()
        worst = torch.zeros(1, dtype=torch.float64)
        with comm.unrecorded():
            for p in self.model.sequence_parallel_params():
                if p.grad is None:
                    continue
                ref = p.grad.detach().clone()
                dist.broadcast(ref, src=self.ctx.mesh.ranks("tp")[0], group=self.group)
                worst = torch.maximum(worst, (p.grad - ref).abs().max().double().view(1))
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.group)
        out["replicated_grad_max_diff"] = float(worst)
        return out


@register
class MegatronSP(Megatron1D):
    name = "tensor.megatron-sp"
    description = ("Megatron sequence parallelism: LayerNorm regions sharded along the "
                   "sequence, all-gather / reduce-scatter around the parallel linears")
    options = ("recompute",)
    sp = True

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        s, t = case.model.seq_length, case.layout.tp
        if s % t:
            raise ConfigError(f"tp={t} does not divide seq_length={s} (sequence parallelism "
                              "shards the sequence)")

    def after_backward(self) -> None:
        """All-reduce the partial gradients of the tp-replicated parameters in one buffer."""
        if self.tp == 1:
            return
        all_reduce_flat([p.grad for p in self.model.sequence_parallel_params()], self.group)
