"""What the native context-parallel schemes must measure, from closed forms and stated rules.

Context parallelism (CP) shards the *sequence* of every sample over the cp ranks; each rank
holds the whole model and computes its s/cp tokens, and only attention needs the other
ranks' keys and values. Nothing here looks at a scheme's own objects: the traffic comes from
the papers' communication patterns, the parameter tensors from the reference model's
architecture (``data_parallel.layer_tensors``), and the layout rules are stated here.

Rules the implementations in ``impls/context`` follow (per layer, per micro-batch of b
samples, e bytes per element, n = s/cp tokens per rank):

- **Ring Self-Attention** (Li et al. 2021, Sec. 3.2, "RSA"; backward as in the authors'
  reference implementation, ColossalAI's ``RingQK`` / ``RingAV``): forward sends the K block
  (b n h) N-1 times around the ring to form the score rows, then the V block N-1 times;
  backward sends V again (N-1) to form dP and K again (N-1) to form dQ, and all-reduces the
  full-sequence partial dV and dK (b s h each) over the cp group; under grouped-query
  attention every K/V figure is at the K/V width h_kv = num_kv_heads head_dim.
  :func:`ring_self_attention_traffic`.
- **Ring Attention** (Liu et al. 2023, Sec. 3): one message of K and V (2 b n h) N-1 times
  forward; K, V again and the dK, dV accumulators N-1 times each in backward
  (``comm.ring_attention_traffic``).
- **DeepSpeed-Ulysses** (Jacobs et al. 2023, Sec. 3.2): 4 all-to-alls of b n h forward,
  4 backward (``comm.ulysses_traffic``). Needs cp | heads.
- **USP** (Fang & Zhao 2024, Sec. 3): a u x r grid of the cp ranks (u = ``cp_ulysses``,
  r = cp/u); Ulysses on the u-groups (axis ``cp_ulysses``, per-rank buffer b n h) and ring
  attention on the r-groups over the gathered r-shard with h/u of the width (axis
  ``cp_ring``, K/V block 2 b (s/r) (h/u)).
- **All-gather CP** (Llama 3, Dubey et al. 2024, Sec. 3.3.2): K and V of the whole sequence
  gathered in forward and again in backward (4 all-gathers of b s h), dK and dV
  reduce-scattered to their owners (2), ``comm.cp_allgather_traffic``.
- Any recomputation (``recompute`` full or selective: the checkpointed region contains the
  attention core) repeats the forward's attention traffic once.
- **Gradients**: one all-reduce of all 4 Psi fp32 gradient bytes per step over the dp x cp
  ranks (axis ``dp_cp``, as Megatron-Core reduces with context parallelism), then / (cp dp).
- **Model states**: a whole replica per rank: 4 Psi parameters, 4 Psi gradients, AdamW's two
  fp32 moments and a 4-byte step per parameter tensor; nothing else held between steps.
"""
from __future__ import annotations

from fractions import Fraction

from . import comm
from .activations import (layer_activation_bytes, reference_block_keywords,
                          reference_layer_activation_bytes)
from .comm import Transfer, summarize
from .data_parallel import layer_tensors
from .prediction import RankPrediction, flat_states
from .shape import Shape, require_positive_int

#: the native schemes' attention algorithms (scheme name without the family)
KINDS = ("ring-self-attention", "ring-attention", "ulysses", "usp", "allgather")
BALANCES = ("none", "zigzag", "striped")
#: the mesh axes USP's 2-D grid is known by in the ledger
ULYSSES_AXIS = "cp_ulysses"
RING_AXIS = "cp_ring"


# ---- traffic ------------------------------------------------------------------------------

def ring_self_attention_traffic(b: int, s: int, h: int, cp: int, layers: int = 1,
                                num_microbatches: int = 1, bytes_per_element: int = 2,
                                recompute: bool = False, axis: str = "cp") -> list[Transfer]:
    """Ring Self-Attention (Li et al. 2021, Sec. 3.2), per layer per micro-batch: forward
    passes K (b (s/N) h) N-1 times, then V N-1 times; backward passes V N-1 times (dP), K N-1
    times (dQ) and all-reduces the partial gradients of the whole sequence's V and K (b s h
    each) -- the authors' ``RingAV`` / ``RingQK``. Recomputation repeats the forward passes.
    ``h`` is K and V's width: under grouped-query attention num_kv_heads x head_dim (the ring
    moves K and V as they are projected; each K/V head's gradient, summed over its query
    group, is what the all-reduce sums)."""
    if cp == 1:
        return []
    if s % cp:
        raise ValueError(f"cp={cp} does not divide seq_length={s}")
    blk = b * (s // cp) * h * bytes_per_element
    n = (cp - 1) * layers * num_microbatches
    fwd = 1 + int(recompute)
    return [Transfer(axis, "send", cp, blk, n * fwd, "K block (fwd)"),
            Transfer(axis, "send", cp, blk, n * fwd, "V block (fwd)"),
            Transfer(axis, "send", cp, blk, n, "V block (bwd, dP)"),
            Transfer(axis, "send", cp, blk, n, "K block (bwd, dQ)"),
            Transfer(axis, "all_reduce", cp, b * s * h * bytes_per_element,
                     2 * layers * num_microbatches, "dV, dK of the whole sequence (bwd)")]


def attention_traffic(kind: str, b: int, s: int, h: int, cp: int, cp_ulysses: int = 1,
                      layers: int = 1, num_microbatches: int = 1, bytes_per_element: int = 4,
                      recompute: bool = False, h_kv: int | None = None) -> list[Transfer]:
    """One rank's attention traffic per step for the native scheme ``kind`` (module doc);
    ``h_kv``: K and V's width under grouped-query attention (default h): ring attention
    passes, and all-gather CP gathers, K/V blocks of that width; Ulysses moves Q and the
    output at h, K and V at h_kv."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {', '.join(KINDS)}")
    e, L, m, kv = bytes_per_element, layers, num_microbatches, h_kv or h
    if kind == "ring-self-attention":
        return ring_self_attention_traffic(b, s, kv, cp, L, m, e, recompute)
    if kind == "ring-attention":
        return comm.ring_attention_traffic(b, s, kv, cp, L, m, e, recompute=recompute)
    if kind == "ulysses":
        return comm.ulysses_traffic(b, s, h, cp, L, m, e, recompute=recompute, h_kv=kv)
    if kind == "allgather":
        if s % cp:
            raise ValueError(f"cp={cp} does not divide seq_length={s}")
        return comm.cp_allgather_traffic(b, s // cp, kv, cp, 1, L, m, e,
                                         ((1, 6 if recompute else 4),),
                                         grad_reduce_scatters=2 if cp > 1 else 0)
    u = cp_ulysses
    require_positive_int("cp_ulysses", u)
    if cp % u:
        raise ValueError(f"cp_ulysses={u} does not divide cp={cp}")
    r = cp // u
    # Ulysses inside a u-group: each rank's buffer is its own s/cp tokens, every head
    out = comm.ulysses_traffic(b, s * u // cp, h, u, L, m, e, recompute=recompute,
                               axis=ULYSSES_AXIS, h_kv=kv)
    # ring attention over the r-groups: the u-group's gathered s/r tokens, 1/u of K/V's width
    out += comm.ring_attention_traffic(b, s, kv // u, r, L, m, e, recompute=recompute,
                                       axis=RING_AXIS)
    return out


def gradient_allreduce(shape: Shape, cp: int, dp: int, elem_bytes: int = 4) -> list[Transfer]:
    """The step's gradient reduction: one all-reduce of every gradient (4 Psi bytes in fp32)
    over the dp x cp ranks (Megatron-Core's ``dp_cp`` group); none on a single rank."""
    n = cp * dp
    psi = sum(x for _, ts in layer_tensors(shape) for x in ts)
    return [Transfer("dp_cp", "all_reduce", n, psi * elem_bytes, 1 if n > 1 else 0,
                     "gradients (one flat buffer)")]


def replica_states(shape: Shape, optimizer: str = "adamw", elem_bytes: int = 4
                   ) -> dict[str, int]:
    """A whole replica's model states (the DDP rule of ``data_parallel``): Psi e parameters,
    Psi e gradients, AdamW's 8 Psi + 4 T; nothing else."""
    return flat_states([x for _, ts in layer_tensors(shape) for x in ts], optimizer,
                       elem_bytes)


class ContextPrediction(RankPrediction):
    """One rank's step of a native context-parallel scheme (every rank alike): its attention
    traffic and gradient all-reduce, a whole replica's model states (:func:`replica_states`)."""


def context_prediction(kind: str, shape: Shape, *, cp: int, dp: int = 1, cp_ulysses: int = 1,
                       micro_batch_size: int, num_microbatches: int = 1, recompute: str = "none",
                       optimizer: str = "adamw", elem_bytes: int = 4) -> ContextPrediction:
    """Everything one rank of the native scheme ``kind`` measures in one step."""
    tr = attention_traffic(kind, micro_batch_size, shape.s, shape.h, cp, cp_ulysses, shape.l,
                           num_microbatches, elem_bytes, recompute != "none",
                           h_kv=shape.kv_hidden)
    tr += gradient_allreduce(shape, cp, dp, elem_bytes)
    tr = [t for t in tr if t.count]
    return ContextPrediction(tr, replica_states(shape, optimizer, elem_bytes),
                             {"transfers": [t.as_dict() for t in tr]})


# ---- causal load balance --------------------------------------------------------------------

def causal_block_work(s: int, cp: int, balance: str) -> list[int]:
    """Query-key pairs each ring rank's attention kernels evaluate per head and sample under a
    causal mask (diagonal blocks count their lower triangle with the diagonal; skipped blocks
    nothing), for the three layouts of the sequence over the ring:

    - ``none``: rank r holds tokens [r n, (r+1) n): its diagonal block and r full blocks,
      r n^2 + n(n+1)/2 -- the last rank works about 2 - 1/cp times the mean (Liu et al. 2023
      leave causal balancing open; Brandon et al. 2023, Sec. 3, quantify the imbalance);
    - ``zigzag``: 2 cp chunks of c = s/(2cp), rank r holds chunks r and 2cp-1-r (Megatron-Core,
      Llama 3 Sec. 3.3.2): a causal 2c block and cp-1 half blocks of 2c x c, equal on every
      rank;
    - ``striped`` (Brandon et al. 2023, Sec. 3.1): rank r holds tokens t = r mod cp: blocks from
      ranks i <= r are causal with the diagonal, from i > r strictly lower,
      (r+1) n(n+1)/2 + (cp-1-r) n(n-1)/2 -- balanced up to n per rank.

    Over the ranks every layout sums to s(s+1)/2."""
    require_positive_int("cp", cp)
    if s % cp:
        raise ValueError(f"cp={cp} does not divide seq_length={s}")
    n = s // cp
    if balance == "none":
        return [r * n * n + n * (n + 1) // 2 for r in range(cp)]
    if balance == "zigzag":
        if s % (2 * cp):
            raise ValueError(f"2*cp={2 * cp} does not divide seq_length={s} (zigzag)")
        c = s // (2 * cp)
        return [c * (2 * c + 1) + (cp - 1) * 2 * c * c for _ in range(cp)]
    if balance == "striped":
        return [(r + 1) * n * (n + 1) // 2 + (cp - 1 - r) * n * (n - 1) // 2
                for r in range(cp)]
    raise ValueError(f"cp_balance={balance!r} must be one of {', '.join(BALANCES)}")


def imbalance(work: list[float]) -> float:
    """Largest rank's work over the mean (1.0: balanced; the step waits for the largest)."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


# ---- activations ---------------------------------------------------------------------------

def cp_layer_activation_bytes(kind: str, s: int, b: int, h: int, a: int, cp: int,
                              recompute: str = "none", ffn_hidden: int | None = None,
                              bytes_per_element: int = 4, kv_hidden: int | None = None,
                              blocks: dict | None = None) -> float:
    """Bytes one layer keeps for backward on one cp rank: Korthikanti et al. 2022 (Eq. 1 and
    Table 2) adapted to the reference model (``reference_layer_activation_bytes``: no dropout,
    fp32, a fused attention kernel saving its output and log-sum-exp, LayerNorm statistics)
    with the sequence shard s/cp in place of s -- every activation of a layer is per token
    except the attention core's, and with a fused kernel that saves Q, K, V, the output and
    a log-sum-exp per row, those are per token too. Ulysses' heads-sharded core holds the
    full sequence with a/cp heads: the same bytes.

    Ring Self-Attention materialises its score rows: the softmax output (s/cp) x s per head
    (Eq. 1's 5as/h term without dropout, one row block of it) replaces the kernel's output
    and log-sum-exp. Full recomputation keeps the layer input (2sbh in Table 2; here e bytes
    per element of the s/cp shard); selective keeps everything but the attention core's
    saved output. ``kv_hidden``: K and V's width under grouped-query attention (the saved K
    and V are s b h_kv each, ``activations`` module doc); RSA's score rows stay one per
    query head. ``blocks``: the LLaMA blocks' keywords (:func:`cp_block_keywords`)."""
    require_positive_int("cp", cp)
    if s % cp:
        raise ValueError(f"cp={cp} does not divide seq_length={s}")
    n = s // cp
    kw = {"bytes_per_element": bytes_per_element, "kv_hidden": kv_hidden, **(blocks or {})}
    layer = reference_layer_activation_bytes(n, b, h, a, 1, False, recompute, ffn_hidden,
                                             **kw)
    if kind != "ring-self-attention" or recompute != "none":
        return layer
    # the kernel's output and log-sum-exp (activations.layer_activation_bytes, "flash")
    # give way to the score rows
    kernel = n * b * h * bytes_per_element + a * n * b * 4
    return layer - kernel + a * n * s * b * bytes_per_element


def cp_block_keywords(m, n: int, b: int) -> dict:
    """The LLaMA blocks' keywords of :func:`cp_layer_activation_bytes` for model ``m`` on a
    rank's n tokens of b samples, as the context family keeps them (``impls.context.shard``):
    the cores make Q, K, V contiguous at the K/V heads' width (``kernel_copies``; no repeat
    before them), RoPE runs before the core, outside selective recomputation's checkpoint
    (``rope_recomputed=False``), on the rank's n positions -- per sample when documents are
    packed (``Documents.pos`` is [b, n]): ``rope_rows`` n or b n; the cores build their
    blocks' masks from the documents and keep none (``attn_mask=False``)."""
    kw = reference_block_keywords(m)
    if not kw:
        return {}
    return {**kw, "kv_repeat": False, "kernel_copies": True, "rope_recomputed": False,
            "rope_rows": n * b if m.pack_docs else n, "attn_mask": False}


def korthikanti_cp_layer_bytes(s: int, b: int, h: int, a: int, cp: int) -> float:
    """Eq. 1 of Korthikanti et al. 2022 on the sequence shard, for comparison: sbh(34 + 5as/h)
    with s/cp tokens of queries (16-bit, dropout) -- what the paper's accounting gives."""
    return layer_activation_bytes(s // cp, b, h, a)


# ---- the dispute of DeepSpeed issue 4217 -----------------------------------------------------

def ulysses_vs_megatron_sp(b: int, s: int, h: int, p: int, bytes_per_element: int = 4,
                           h_kv: int | None = None) -> dict[str, float]:
    """Per-rank wire bytes of one layer's forward, both at degree p on the same b x s x h
    activations (DeepSpeed issue 4217):

    - Ulysses (Jacobs et al. 2023, Sec. 3.2): 4 all-to-alls of the rank's b (s/p) h shard,
      each sending (p-1)/p of it: 4 (p-1)/p^2 b s h -- the paper's "4Nh/P per link" with the
      (p-1)/p factor of a real all-to-all;
    - Megatron-SP (Korthikanti et al. 2022, Sec. 4.2.2): 2 all-gathers and 2 reduce-scatters
      of the full b s h activation, each (p-1)/p of it per rank: 4 (p-1)/p b s h -- constant in
      p ("4Nh"), although each rank holds only s/p of the sequence.

    The ratio is exactly p (with grouped-query attention's narrower K and V, ``h_kv``,
    Ulysses moves less and the ratio exceeds p). ``paper_*`` are the DeepSpeed paper's
    per-link figures in bytes."""
    e = bytes_per_element
    uly = summarize(comm.ulysses_traffic(b, s, h, p, bytes_per_element=e, backward=False,
                                         h_kv=h_kv))
    msp = summarize(comm.tp_traffic(b, s, h, p, bytes_per_element=e, sp=True))
    uly_fwd = Fraction(uly["cp"]["wire_bytes"]) if uly else Fraction(0)
    # tp_traffic counts forward and backward (2 + 2 each way): half of it is the forward
    msp_fwd = Fraction(msp["tp"]["wire_bytes"]) / 2 if msp else Fraction(0)
    return {"ulysses_fwd_bytes_per_layer": float(uly_fwd),
            "megatron_sp_fwd_bytes_per_layer": float(msp_fwd),
            "ratio_megatron_sp_over_ulysses": float(msp_fwd / uly_fwd) if uly_fwd else None,
            "paper_ulysses_per_link": float(comm.ulysses_paper_per_link(b * s, h, p) * e),
            "paper_megatron_sp_per_link": float(4 * b * s * h * e)}
