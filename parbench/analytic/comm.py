"""Communication volume: per-collective wire bytes and the traffic of each parallelism.

Conventions, the same as the harness ledger (DESIGN.md, "Ledger"):

- ``message_bytes`` S is the full message: the all-reduced buffer, the *gathered* output of an
  all-gather, the full input of a reduce-scatter, one rank's whole send buffer of an
  all-to-all, the broadcast buffer, the sent tensor.
- ``wire_bytes`` is what one rank sends with a bandwidth-optimal (ring) algorithm on a group of
  n ranks (Thakur et al. 2005; Patarasuk & Yuan 2009): all-reduce 2(n-1)/n S (reduce-scatter
  then all-gather), all-gather / reduce-scatter / all-to-all (n-1)/n S, broadcast S, send S;
  0 on a group of one rank (no peer) except for a point-to-point send.

Wire bytes are computed with rational arithmetic and returned as ``int`` when whole, else as a
correctly rounded ``float``. Each traffic function returns a list of :class:`Transfer` records
for one rank and one training iteration (or the stated unit), so that totals per mesh axis
can be compared record for record with the measured ledger.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Sequence

from .memory import shard_numel
from .shape import require_nonneg_int, require_positive_int

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send",
       "reduce", "gather", "scatter", "recv", "barrier")


def as_number(x: Fraction) -> int | float:
    """``x`` as an ``int`` when whole, else as the nearest ``float``."""
    return int(x) if x.denominator == 1 else float(x)


_num = as_number


def wire_factor(op: str, n: int) -> Fraction:
    """Per-rank wire bytes per message byte for ``op`` on ``n`` ranks (see module doc)."""
    require_positive_int("group_size", n)
    if op == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return Fraction(n - 1, n)
    if op == "broadcast":
        return Fraction(1 if n > 1 else 0)
    if op == "send":
        return Fraction(1)
    if op in ("reduce", "gather", "scatter"):  # a non-root rank's share; see rooted_wire_factor
        return rooted_wire_factor(op, n, 1, 0) if n > 1 else Fraction(0)
    if op in ("recv", "barrier"):
        return Fraction(0)
    raise ValueError(f"op={op!r} must be one of {', '.join(OPS)}")


#: the ops whose per-rank bytes depend on the rank's role (the root)
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def rooted_wire_factor(op: str, n: int, group_rank: int, root: int) -> Fraction:
    """Per-rank factor of a rooted op for rank ``group_rank`` of ``n`` with root ``root``.

    - broadcast: a pipelined chain from the root (root, root+1, ..., root-1): every rank but the
      last of the chain forwards the S-byte message once, S; the last sends nothing;
    - reduce: the same chain towards the root: every rank but the root sends S (partial sums);
    - gather: each non-root rank sends its S/n block to the root; the root sends nothing;
    - scatter: the root sends the n-1 other blocks, (n-1)/n S; the others send nothing.

    These are bandwidth-optimal for large messages (Thakur et al. 2005, Sec. 4) and sum over
    the group to the bytes that must cross the network. Non-rooted ops use ``wire_factor``.
    """
    require_positive_int("group_size", n)
    if n == 1:
        return Fraction(0)
    if op == "broadcast":
        return Fraction(0 if group_rank == (root - 1) % n else 1)
    if op == "reduce":
        return Fraction(0 if group_rank == root else 1)
    if op == "gather":
        return Fraction(0 if group_rank == root else 1, n)
    if op == "scatter":
        return Fraction(n - 1, n) if group_rank == root else Fraction(0)
    return wire_factor(op, n)


def wire_bytes(op: str, n: int, message_bytes: float) -> int | float:
    """Bytes one rank sends for one ``op`` of ``message_bytes`` on ``n`` ranks."""
    return _num(wire_factor(op, n) * Fraction(message_bytes))


@dataclass(frozen=True)
class Transfer:
    """``count`` identical collectives (or sends) made by one rank."""

    axis: str
    op: str
    group_size: int
    message_bytes: int | float
    count: int
    what: str = ""

    @property
    def wire_bytes(self) -> int | float:
        """Per transfer."""
        return wire_bytes(self.op, self.group_size, self.message_bytes)

    @property
    def total_wire_bytes(self) -> int | float:
        return _num(wire_factor(self.op, self.group_size) * Fraction(self.message_bytes)
                    * self.count)

    @property
    def total_message_bytes(self) -> int | float:
        return _num(Fraction(self.message_bytes) * self.count)

    def as_dict(self) -> dict:
        return {"axis": self.axis, "op": self.op, "group_size": self.group_size,
                "message_bytes": self.message_bytes, "wire_bytes": self.wire_bytes,
                "count": self.count, "total_wire_bytes": self.total_wire_bytes,
                "total_message_bytes": self.total_message_bytes, "what": self.what}


def summarize(transfers: Iterable[Transfer]) -> dict[str, dict]:
    """Totals per mesh axis: ``{axis: {count, message_bytes, wire_bytes}}``."""
    out: dict[str, dict] = {}
    for tr in transfers:
        row = out.setdefault(tr.axis, {"count": 0, "message_bytes": Fraction(0),
                                       "wire_bytes": Fraction(0)})
        row["count"] += tr.count
        row["message_bytes"] += Fraction(tr.message_bytes) * tr.count
        row["wire_bytes"] += wire_factor(tr.op, tr.group_size) * Fraction(tr.message_bytes) \
            * tr.count
    for row in out.values():
        row["message_bytes"] = _num(row["message_bytes"])
        row["wire_bytes"] = _num(row["wire_bytes"])
    return out


def _keep(transfers: Sequence[Transfer]) -> list[Transfer]:
    return [t for t in transfers if t.count > 0]


# ---------------------------------------------------------------------------------------
# data parallel and ZeRO
# ---------------------------------------------------------------------------------------

def ddp_traffic(grad_bytes: float, dp: int, buckets: int = 1) -> list[Transfer]:
    """DDP: one all-reduce of all gradients per step, 2(d-1)/d Psi bytes on the wire
    (Li et al. 2020, "PyTorch Distributed"), split into ``buckets`` equal buckets."""
    require_positive_int("buckets", buckets)
    return _keep([Transfer("dp", "all_reduce", dp, _num(Fraction(grad_bytes) / buckets),
                           buckets if dp > 1 else 0, "gradient bucket")])


def zero_traffic(params: int, dp: int, stage: int, param_bytes: int = 2,
                 grad_bytes: int | None = None, pad: bool = True) -> list[Transfer]:
    """Per-step traffic of ZeRO-DP (Rajbhandari et al. 2020, Sec. 7).

    Stage 0: all-reduce of the gradients (2Psi, like DDP). Stages 1 and 2: reduce-scatter of
    the gradients plus all-gather of the updated parameters -- Psi + Psi = 2Psi, the same
    volume as DDP. Stage 3: all-gather of the parameters in forward, again in backward, and a
    reduce-scatter of the gradients -- 3Psi, 1.5x. Wire bytes carry the (d-1)/d ring factor.
    With ``pad`` the flat buffer is padded to a multiple of ``dp`` (:func:`memory.shard_numel`),
    as partitioned implementations do.
    """
    require_nonneg_int("numel", params)
    gb = param_bytes if grad_bytes is None else grad_bytes
    n = dp * shard_numel(params, dp) if pad else params
    if stage == 0:
        return ddp_traffic(params * gb, dp)
    if dp == 1:
        return []
    if stage in (1, 2):
        return [Transfer("dp", "reduce_scatter", dp, n * gb, 1, "gradients"),
                Transfer("dp", "all_gather", dp, n * param_bytes, 1, "updated parameters")]
    if stage == 3:
        return [Transfer("dp", "all_gather", dp, n * param_bytes, 2,
                         "parameters (forward and backward)"),
                Transfer("dp", "reduce_scatter", dp, n * gb, 1, "gradients")]
    raise ValueError(f"zero_stage={stage} must be one of 0, 1, 2, 3")


# ---------------------------------------------------------------------------------------
# tensor and sequence parallel (Megatron)
# ---------------------------------------------------------------------------------------

def tp_traffic(b: int, s: int, h: int, tp: int, layers: int = 1, num_microbatches: int = 1,
               bytes_per_element: int = 2, recompute: bool = False,
               sp: bool = False) -> list[Transfer]:
    """Megatron tensor parallelism (Shoeybi et al. 2019, Sec. 3; Korthikanti et al. 2022,
    Sec. 4.2.2), per layer per micro-batch on b x s x h activations:

    without sequence parallelism, 2 all-reduces forward (after the attention projection and
    after the MLP, operator g) and 2 backward (operator f), each of S = bsh elements:
    4 x 2(t-1)/t bsh = 8bsh(t-1)/t elements (times bytes per element) on the wire; full
    recomputation repeats the 2 forward ones: 6 all-reduces. With sequence parallelism each
    all-reduce becomes an all-gather plus a reduce-scatter of the same S, (t-1)/t S each, so
    the same bandwidth.
    """
    msg = b * s * h * bytes_per_element
    count = (6 if recompute else 4) * layers * num_microbatches
    if tp == 1:
        return []
    if not sp:
        return [Transfer("tp", "all_reduce", tp, msg, count, "g (fwd) / f (bwd)")]
    return [Transfer("tp", "all_gather", tp, msg, count, "sequence-parallel g / g-bar"),
            Transfer("tp", "reduce_scatter", tp, msg, count, "sequence-parallel g-bar / g")]


def tp_vocab_traffic(b: int, s: int, h: int, tp: int, num_microbatches: int = 1,
                     bytes_per_element: int = 2, loss_bytes: int = 4) -> list[Transfer]:
    """Vocabulary-parallel embedding and cross-entropy (Shoeybi et al. 2019, Sec. 3), per
    micro-batch: the embedding output is all-reduced in forward (first stage); the LM head
    input's gradient is all-reduced in backward (last stage); the loss needs 3 all-reduces of
    b s values (maximum logit, target logit, sum of exponentials) in ``loss_bytes``."""
    if tp == 1:
        return []
    act = b * s * h * bytes_per_element
    return [Transfer("tp", "all_reduce", tp, act, num_microbatches, "embedding output (fwd)"),
            Transfer("tp", "all_reduce", tp, act, num_microbatches, "LM head input grad (bwd)"),
            Transfer("tp", "all_reduce", tp, b * s * loss_bytes, 3 * num_microbatches,
                     "vocab-parallel cross-entropy")]


# ---------------------------------------------------------------------------------------
# context parallel
# ---------------------------------------------------------------------------------------

def ulysses_traffic(b: int, s: int, h: int, cp: int, layers: int = 1, num_microbatches: int = 1,
                    bytes_per_element: int = 2, backward: bool = True,
                    recompute: bool = False, axis: str = "cp",
                    h_kv: int | None = None) -> list[Transfer]:
    """DeepSpeed-Ulysses (Jacobs et al. 2023, Sec. 3.2): per layer 4 all-to-alls forward (Q, K,
    V sequence -> heads; the attention output heads -> sequence) and the 4 inverse ones in
    backward (4 more when the forward is recomputed). One rank's buffer is its sequence shard
    with every head, b (s/P) h elements, of which (P-1)/P leaves the rank. The paper states the
    volume as 4Nh/P per link for an aggregate message of Nh (N = s tokens of the micro-batch):
    see :func:`ulysses_paper_per_link`. ``axis`` names the group (USP runs Ulysses on a
    sub-axis of cp). ``h_kv``: the width of K and V under grouped-query attention (Ainslie
    et al. 2023; num_kv_heads x head_dim): their two all-to-alls move b (s/P) h_kv each."""
    if cp == 1:
        return []
    if s % cp:
        raise ValueError(f"cp={cp} does not divide seq_length={s}")
    per_layer = (1 + int(backward) + int(recompute)) * layers * num_microbatches
    msg = b * (s // cp) * h * bytes_per_element
    if h_kv is None or h_kv == h:
        return [Transfer(axis, "all_to_all", cp, msg, 4 * per_layer, "Q, K, V, output")]
    kv = b * (s // cp) * h_kv * bytes_per_element
    return [Transfer(axis, "all_to_all", cp, msg, 2 * per_layer, "Q, output"),
            Transfer(axis, "all_to_all", cp, kv, 2 * per_layer, "K, V (grouped heads)")]


def ulysses_paper_per_link(N: int, h: int, P: int) -> Fraction:  # noqa: N803
    """4Nh/P elements per link per layer forward (Jacobs et al. 2023, Sec. 3.2)."""
    return Fraction(4 * N * h, P)


def ring_attention_traffic(b: int, s: int, h_kv: int, cp: int, layers: int = 1,
                           num_microbatches: int = 1, bytes_per_element: int = 2,
                           backward: bool = True, recompute: bool = False,
                           axis: str = "cp") -> list[Transfer]:
    """Ring Attention (Liu et al. 2023, Sec. 3, Algorithm 1): each layer's forward passes the
    local K and V block (one message of 2 b (s/N) h_kv elements) N - 1 times around the ring;
    backward passes K, V again and the accumulated dK, dV block, N - 1 times each (a block's
    gradient accumulator starts on the rank after its owner and reaches the owner with the
    last hop). Full recomputation repeats the forward passes. ``h_kv`` is this rank's K/V
    width (h / t under tensor parallelism, h / u inside USP's Ulysses groups)."""
    if cp == 1:
        return []
    if s % cp:
        raise ValueError(f"cp={cp} does not divide seq_length={s}")
    kv = 2 * b * (s // cp) * h_kv * bytes_per_element
    n = (cp - 1) * layers * num_microbatches
    out = [Transfer(axis, "send", cp, kv, n * (1 + int(recompute)), "K, V block (fwd)")]
    if backward:
        out += [Transfer(axis, "send", cp, kv, n, "K, V block (bwd)"),
                Transfer(axis, "send", cp, kv, n, "dK, dV block (bwd)")]
    return out


def cp_allgather_traffic(b: int, s_local: int, h: int, cp: int, tp: int = 1,
                         layers: int = 1, num_microbatches: int = 1, bytes_per_element: int = 2,
                         gathers: Sequence[tuple[int, int]] = ((1, 4),),
                         grad_reduce_scatters: int = 0, axis: str = "cp") -> list[Transfer]:
    """All-gather context parallelism (as in Llama 3, Dubey et al. 2024, Sec. 3.3.2): K and V of
    the whole sequence are gathered before attention. One gathered tensor is
    A = b (s_local cp) (h / t) elements -- the full sequence, this rank's heads.
    ``gathers`` lists (tensors per gather, gathers per layer per micro-batch): the default
    gathers K and V separately in forward and again in backward (the gathered K, V are not
    kept, as TransformerEngine's all-gather CP does); ``((1, 6),)`` adds the recompute pass;
    ``(2, k)`` gathers K and V together as one 2A message. ``grad_reduce_scatters`` adds that
    many reduce-scatters of A per layer per micro-batch: the gradients of the gathered K and
    V (dK, dV of the full sequence) returned to their owners, the all-gather's transpose."""
    if cp == 1:
        return []
    if h % tp:
        raise ValueError(f"tp={tp} does not divide hidden_size={h}")
    a = b * s_local * cp * (h // tp) * bytes_per_element
    out = [Transfer(axis, "all_gather", cp, k * a, n * layers * num_microbatches,
                    f"{'K and V' if k == 2 else 'K or V'} of the full sequence")
           for k, n in gathers]
    if grad_reduce_scatters:
        out.append(Transfer(axis, "reduce_scatter", cp, a,
                            grad_reduce_scatters * layers * num_microbatches,
                            "dK or dV of the full sequence to its owners"))
    return out


# ---------------------------------------------------------------------------------------
# pipeline and expert parallel
# ---------------------------------------------------------------------------------------

def pipeline_p2p_traffic(b: int, s: int, h: int, pp: int, num_microbatches: int, rank: int = 0,
                         vpp: int = 1, tp: int = 1, scatter_gather: bool = False,
                         bytes_per_element: int = 2) -> list[Transfer]:
    """Point-to-point sends of one pipeline rank per iteration (Narayanan et al. 2021,
    Sec. 4.1): b s h elements per stage boundary per micro-batch in each direction
    (activations forward, their gradients backward). With ``vpp`` chunks per rank a rank
    crosses v boundaries per micro-batch. With the scatter/gather optimisation each of the t
    tensor-parallel ranks sends only bsh/t and the receivers all-gather the rest over the
    tensor-parallel group. The last rank's last chunk sends no activations and the first
    rank's first chunk no gradients: over all ranks 2 m (p v - 1) sends."""
    require_positive_int("pp", pp)
    if not 0 <= rank < pp:
        raise ValueError(f"rank={rank} must be in [0, pp={pp})")
    if pp == 1:
        return []
    msg = b * s * h * bytes_per_element
    if scatter_gather:
        if msg % tp:
            raise ValueError(f"tp={tp} does not divide the boundary tensor of {msg} bytes")
        msg //= tp
    fwd = num_microbatches * (vpp - (rank == pp - 1))
    bwd = num_microbatches * (vpp - (rank == 0))
    out = [Transfer("pp", "send", pp, msg, fwd, "activations"),
           Transfer("pp", "send", pp, msg, bwd, "activation gradients")]
    if scatter_gather and tp > 1:
        out.append(Transfer("tp", "all_gather", tp, msg * tp, fwd + bwd, "scatter/gather"))
    return _keep(out)


def pipeline_total_sends(pp: int, num_microbatches: int, vpp: int = 1) -> int:
    """Point-to-point sends over all pipeline ranks per iteration: 2 m (p v - 1)."""
    return 2 * num_microbatches * (pp * vpp - 1)


def expert_traffic(tokens: int, h: int, ep: int, moe_layers: int = 1, num_microbatches: int = 1,
                   top_k: int = 1, bytes_per_element: int = 2, recompute: bool = False,
                   capacity_factor: float | None = None,
                   num_experts: int | None = None) -> list[Transfer]:
    """Expert parallelism (Lepikhin et al. 2020, GShard; Fedus et al. 2021, Switch): per MoE
    layer an all-to-all dispatches tokens to their experts and one combines the results, in
    forward, and the two are mirrored in backward (plus two more with full recomputation).
    One rank's buffer holds ``tokens * top_k`` rows of h elements, or with a capacity factor
    E slots of ceil(cf * tokens * k / E) rows (dropped tokens leave padding); (n-1)/n of it
    leaves the rank."""
    if ep == 1:
        return []
    rows = tokens * top_k
    if capacity_factor is not None:
        if not num_experts:
            raise ValueError("num_experts is required with capacity_factor")
        cap = -(-Fraction(capacity_factor) * rows // num_experts)
        rows = num_experts * int(cap)
    msg = rows * h * bytes_per_element
    per_layer = 6 if recompute else 4
    return [Transfer("ep", "all_to_all", ep, msg, per_layer * moe_layers * num_microbatches,
                     "dispatch / combine")]
