"""Context parallelism for Megatron-Core's ``GPTModel`` on a CPU: CPU shims 6 and 7 (issue 21).

Megatron-Core 0.16.1 runs context parallelism only in TransformerEngine's
``TEDotProductAttention`` (its ``AttnFuncWithCPAndKVP2P``: ring attention over the cp group,
causal load balancing by 2 cp chunks, rank r holding chunks r and 2cp-1-r); the local spec's
``DotProductAttention`` asserts ``context_parallel_size == 1`` and TransformerEngine does not
install on a CPU host.

**Shim 6** (:class:`RingCoreAttention`) replaces only that core: the local spec's
``core_attention`` submodule, given Megatron's per-rank ``query`` / ``key`` / ``value``
([s/cp, b, heads/tp, d], after its own QKV projection, split and RoPE) returns the attention
of this rank's two chunks over the whole sequence, [s/cp, b, heads/tp * d], by torch's ring
attention (``_templated_ring_attention`` / ``_templated_ring_attention_backward`` of
``torch.distributed.tensor.experimental._context_parallel``, the calls
``baseline.torch.context_parallel`` makes, here on plain tensors) with torch's CPU
flash-attention kernels: its causal head-tail load balancing is TransformerEngine's layout
(Liu et al. 2023, "Ring Attention"; Brandon et al. 2023, "Striped Attention"), its rotation
torch's default (K / V all-gathered, dK / dV returned by all-to-all), its merge of the
blocks' outputs by their log-sum-exp in fp32. No ring is written here. yunchang's zig-zag
ring has the same layout but its backward is wrong in fp32 (``scripts/
yunchang_fp32_repro.py``). The ring carries each group's K / V, as TransformerEngine's;
each block repeats them for their query heads (torch's CPU kernel needs equal head counts)
as ``DotProductAttention`` does, and sums their gradients back per group. The cp group is the model's ``pg_collection.cp`` (``parallel_state``'s, the mesh's handle).

What of Megatron's own context-parallel code then runs unchanged:

- ``megatron.core.utils.get_batch_on_this_cp_rank``: the zig-zag split of each micro-batch's
  tokens, labels and position ids (:func:`cp_batch`);
- RoPE per cp chunk: ``RotaryEmbedding.get_rotary_seq_len`` (local length x cp) and
  ``RotaryEmbedding.forward`` -> ``rope_utils.get_pos_emb_on_this_cp_rank`` (the global
  positions of this rank's two chunks);
- the loss over cp: Megatron-LM's ``pretrain_gpt.loss_func`` contract (:func:`cp_mean`: the
  rank's loss sum and token count all-reduced over cp, the gradient reaching the rank's own
  tokens), multiplied by the cp size in the schedule's ``forward_step_calc_loss``, so that
- the gradient reduction over dp x cp (``DistributedDataParallel`` on the dp_cp group, scaled
  by 1/(dp cp), run by ``finalize_model_grads``) yields the gradient of the global mean;
- the pipeline's p2p shapes [s/cp, b, h] (``get_tensor_shapes``).

**Shim 7** (:class:`CudaTransfersOnCpu`, while the schedule runs on a CPU-only torch):
``get_pos_emb_on_this_cp_rank`` builds its two chunk indices with ``pin_memory=True`` and
moves them with ``.cuda(non_blocking=True)``; both are made no-ops (with shim 2's
``device="cuda"`` -> CPU). Neither changes an index or a value.
"""
from __future__ import annotations

import math

import torch

from impls.baselines.megatron_ptdp import _CudaFactoriesOnCpu

_ATEN = torch.ops.aten


def _grouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K / V [b, groups, s, d] repeated for their ``heads`` queries (query head i reads group
    i // (heads / groups), as Megatron's ``DotProductAttention`` repeats them)."""
    rep = heads // t.shape[1]
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _cpu_block(query, key, value, **kw):
    """One ring block by torch's CPU flash attention, K / V given per query group."""
    h = query.shape[1]
    return _ATEN._scaled_dot_product_flash_attention_for_cpu(
        query, _grouped(key, h), _grouped(value, h), **kw)


def _cpu_block_backward(grad_out, query, key, value, out, logsumexp, **kw):
    """Its backward; dK / dV summed over each group's query heads."""
    b, g, s, d = key.shape
    dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, _grouped(key, query.shape[1]), _grouped(value, query.shape[1]),
        out, logsumexp, **kw)[:3]
    return dq, dk.view(b, g, -1, s, d).sum(2), dv.view(b, g, -1, s, d).sum(2)


class _TorchRing(torch.autograd.Function):
    """torch's ring attention on plain local tensors (q [b, heads, s/cp, d], K / V [b,
    groups, s/cp, d]) over ``group``: ``_templated_ring_attention`` and its ``_backward``
    (torch.distributed.tensor.experimental._context_parallel) with torch's CPU
    flash-attention kernels -- the calls ``baseline.torch.context_parallel`` registers for
    DTensor, without the DTensor; the ring carries the groups' K / V."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        import torch.distributed.tensor.experimental._context_parallel._attention as ring
        out, lse = ring._templated_ring_attention(
            group, 2, _cpu_block, q, k, v,
            is_causal=True, dropout_p=0.0, scale=scale)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        import torch.distributed.tensor.experimental._context_parallel._attention as ring
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring._templated_ring_attention_backward(
            ctx.group, 2, _cpu_block_backward, grad_out.contiguous(), "grad_out", q, k, v,
            out, lse, is_causal=True,
            dropout_p=0.0, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None


class RingCoreAttention(torch.nn.Module):
    """CPU shim 6: Megatron's core-attention contract (``DotProductAttention``'s constructor
    and ``forward``) computed by torch's ring attention over the model's cp group; causal
    self-attention only (what TransformerEngine's p2p context parallelism runs here)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType
        if attn_mask_type != AttnMaskType.causal or config.window_size is not None:
            raise ValueError(f"{type(self).__name__} runs causal full attention only, "
                             f"not {attn_mask_type}")
        if (attention_dropout or config.attention_dropout) or \
                config.apply_query_key_layer_scaling:
            raise ValueError(f"{type(self).__name__}: no dropout, no layer scaling")
        self.config, self.cp_group = config, pg_collection.cp
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """[s/cp, b, heads, d] query, [s/cp, b, groups, d] key / value -> [s/cp, b,
        heads d]; ``attention_mask`` is unused (causal over the zig-zag chunks)."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(f"{type(self).__name__}: no attention bias, no packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))
        out = _TorchRing.apply(q, k, v, self.cp_group, self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def ring_spec(spec):
    """Layer spec ``spec`` with :class:`RingCoreAttention` as its attention's core."""
    import dataclasses
    attn = spec.submodules.self_attention
    core = dataclasses.replace(attn.submodules, core_attention=RingCoreAttention)
    attn = dataclasses.replace(attn, submodules=core)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def cp_batch(tokens, targets, cp_group):
    """This cp rank's zig-zag chunks of a micro-batch by Megatron's own
    ``get_batch_on_this_cp_rank``: (tokens, labels, position ids), each [b, s/cp]."""
    from megatron.core.utils import get_batch_on_this_cp_rank
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s).contiguous()
    batch = get_batch_on_this_cp_rank(
        {"tokens": tokens, "labels": targets, "position_ids": pos}, cp_group)
    return batch["tokens"], batch["labels"], batch["position_ids"]


def cp_mean(losses, cp_group):
    """The micro-batch's mean token loss over the whole sequence, as Megatron-LM's
    ``pretrain_gpt.loss_func`` computes it for the schedule's two-value loss contract: this
    rank's loss sum and token count all-reduced over cp (outside autograd: the gradient
    reaches this rank's tokens only, 1/N each), the sum over the count. The schedule then
    multiplies it by cp (``forward_step_calc_loss``) and DDP averages over dp x cp, giving
    the gradient of the global mean. A rank's own mean here would double it at cp = 2."""
    import torch.distributed as dist
    total = torch.cat([losses.sum().view(1), losses.new_tensor([losses.numel()])])
    if dist.get_world_size(cp_group) > 1:
        dist.all_reduce(total, group=cp_group)
    return total[0] / total[1]


class CudaTransfersOnCpu(_CudaFactoriesOnCpu):
    """Shims 2 and 7: ``device="cuda"`` means the CPU; ``pin_memory=True`` and
    ``Tensor.cuda()`` are no-ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = kwargs or {}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return super().__torch_function__(func, types, args, kwargs)
