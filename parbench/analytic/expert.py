"""What the native expert-parallel scheme must measure, from closed forms and stated rules.

Expert parallelism (GShard, Lepikhin et al. 2020, Sec. 2.2-3.2; Switch Transformer, Fedus et
al. 2021, Sec. 2) shards the E experts of every MoE layer over the ep ranks and replicates
everything else. Nothing here looks at a scheme's objects: the parameter tensors come from
the reference model's architecture (``parbench.model``; router ``h -> E`` without bias, expert
MLPs of the dense MLP's shape), the capacity from Switch Eq. 3, the traffic from GShard's
dispatch / combine all-to-alls. The model is read by field name (a ``Shape``, a
``ModelConfig`` or any object with the reference model's fields).

Rules the implementation in ``impls/expert`` follows (per rank, per step; d = dp data-parallel
ranks, ep | d, n = edp = d / ep expert-data-parallel ranks, m micro-batches of b samples of s
tokens, T = b s tokens per routing group, e bytes per element, L_moe MoE layers):

- **Capacity** (Switch Eq. 3, k routed copies per token as in GShard Sec. 2.2):
  C = ceil(cf k T / E) slots per expert and group, the factor taken as the decimal it prints
  as (1.1 = 11/10); cf = 0 means no limit, C = T (a token takes at most one slot of an
  expert). One routing group per rank and micro-batch: capacity is per rank, not global.
- **All-to-all** (GShard Sec. 3.2, Algorithm 2): each MoE layer exchanges the dispatch buffer
  ``[E, C, h]`` (E C h e bytes, padding slots included) over the ep group, and the expert
  outputs back, in forward; backward mirrors both: 4 all-to-alls per MoE layer per
  micro-batch, each (ep-1)/ep E C h e bytes on the wire (the rank's own E/ep experts' block
  stays). None with ep = 1.
- **Gradients**: the dense gradients (router included) in one flat all-reduce over dp,
  2(d-1)/d of 4 Psi_dense; the rank's expert gradients in one flat all-reduce over edp,
  2(n-1)/n of 4 Psi_expert / ep (Psi_expert: every expert of every MoE layer). None over a
  group of one rank.
- **Clipping** by global norm (``clip_grad`` > 0; Pascanu et al. 2013; Megatron-LM's
  ``clip_grad_norm_fp32`` with the experts' norm reduced over the expert-parallel group):
  the dense gradients are whole on every rank after their all-reduce and the experts are
  sharded over ep, so one all-reduce of the 4-byte squared norm over ep
  (``analytic.clip``); none with ep = 1.
- **Model states** (fp32, AdamW: two fp32 moments per element and a 4-byte step per tensor):
  the dense parameters whole, E/ep experts of every MoE layer; parameters, gradients and
  optimizer states of exactly those; nothing else held between steps but the balancing
  biases below.
- **DeepSeek-style layers** (DeepSeek-V3 Technical Report, arXiv 2412.19437, Sec. 2.1.2):
  routed experts of hidden size ``expert_f`` (fine-grained), the shared expert's MLP a dense
  parameter (all-reduced over dp with the rest), the first ``moe_first_dense`` layers dense
  (``Shape.is_moe_layer``). With the balancing bias (``moe_bias_update_rate`` > 0) each MoE
  layer's router holds E float32 biases (4 E L_moe bytes of state, "other"), updated after
  each step from the global load: one all-reduce over dp of the ``[L_moe, E]`` float32
  loads, 2(d-1)/d of 4 E L_moe bytes.

Switch Eq. 4 (the load-balancing loss) and ST-MoE Eq. 5 (the router z-loss) are the
reference model's (``parbench.model.moe``); their cost is local, no traffic.
"""
from __future__ import annotations

from .clip import norm_transfers
from .comm import Transfer, as_number, wire_factor
from .prediction import RankPrediction, flat_states
from .params import dense_block_tensor_sizes, norm_tensor_sizes
from .shape import Shape, expert_capacity, require_positive_int, shape_from


def capacity(tokens: int, num_experts: int, top_k: int = 1, capacity_factor: float = 1.0
             ) -> int:
    """Slots per expert in a routing group of ``tokens`` tokens (Switch Eq. 3 with k copies,
    ``shape.expert_capacity``): ceil(cf k T / E); cf = 0: no limit, T slots (a token takes at
    most one slot of an expert)."""
    c = expert_capacity(tokens, num_experts, top_k, capacity_factor)
    return tokens if c is None else c


def _moe_shape(model) -> Shape:
    shape = shape_from(model)
    require_positive_int("num_experts", shape.num_experts)
    return shape


def expert_numel(shape: Shape) -> int:
    """P_e: one routed expert MLP's parameters, h -> f_e -> h with biases (hf_e + f_e + f_e h
    + h; f_e = ``expert_f``, the fine-grained experts' hidden size); SwiGLU experts (Mixtral)
    hold 2 f_e fc1 rows, bias-free ones no bias (:func:`mlp_tensor_sizes`)."""
    return sum(mlp_tensor_sizes(shape.h, shape.expert_f, shape.gated, shape.bias))


def mlp_tensor_sizes(h: int, f: int, gated: bool = False, bias: bool = True) -> list[int]:
    """One MLP's tensors: fc1 (f h, f), fc2 (h f, h) for GELU with biases; fc1 [gate; up]
    (2f h) for SwiGLU; no biases under ``bias=false`` (``blocks.MLP``)."""
    rows = 2 * f if gated else f
    return [rows * h] + ([rows] if bias else []) + [h * f] + ([h] if bias else [])


def rank_tensors(shape: Shape, ep: int) -> tuple[list[int], list[int]]:
    """Sizes of the parameter tensors one rank holds: (dense, expert). Dense: embedding (V h,
    s h), per layer (``params.dense_block_tensor_sizes``; GPT-2: LN 2 x h, QKV 3h^2 + 3h,
    projection h^2 + h, LN 2 x h) and either the MLP (hf + f, fh + h) or the router (E h);
    the head's norm and V h unless tied; on MoE layers the shared expert's MLP (hidden
    ``moe_shared_expert_size``) after the router. Expert: E/ep experts of each MoE layer,
    each h f_e + f_e, f_e h + h (:func:`mlp_tensor_sizes`: SwiGLU, bias-free)."""
    require_positive_int("ep", ep)
    if shape.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={shape.num_experts}")
    h = shape.h
    block = dense_block_tensor_sizes(shape)
    cut = len(block) - (4 if shape.bias else 2)  # the MLP's fc1 and fc2 come last
    attn, mlp = block[:cut], block[cut:]
    dense = [shape.V * h] + ([shape.s * h] if shape.position_embeddings else [])
    expert: list[int] = []
    for i in range(shape.l):
        dense += attn
        if shape.is_moe_layer(i):
            dense.append(shape.num_experts * h)
            if shape.moe_shared_expert_size:
                dense += mlp_tensor_sizes(h, shape.moe_shared_expert_size, shape.gated,
                                          shape.bias)
            expert += mlp_tensor_sizes(h, shape.expert_f, shape.gated, shape.bias) \
                * (shape.num_experts // ep)
        else:
            dense += mlp
    dense += norm_tensor_sizes(shape) + ([] if shape.tie_embeddings else [shape.V * h])
    return dense, expert


def alltoall_traffic(shape: Shape, ep: int, micro_batch_size: int, num_microbatches: int = 1,
                     elem_bytes: int = 4) -> list[Transfer]:
    """GShard's dispatch and combine all-to-alls of the ``[E, C, h]`` buffer, forward and
    backward, per MoE layer per micro-batch (module docstring)."""
    c = capacity(micro_batch_size * shape.s, shape.num_experts, shape.moe_top_k,
                 shape.moe_capacity_factor)
    msg = shape.num_experts * c * shape.h * elem_bytes
    n = shape.num_moe_layers * num_microbatches if ep > 1 else 0
    return [Transfer("ep", "all_to_all", ep, msg, n, what) for what in
            ("dispatch (fwd)", "combine (fwd)", "combine grad (bwd)", "dispatch grad (bwd)")]


def gradient_traffic(shape: Shape, ep: int, dp: int, elem_bytes: int = 4,
                     clip_grad: float = 0.0) -> list[Transfer]:
    """The step's two gradient all-reduces: dense over dp, the rank's experts over edp; with
    ``clip_grad``, the norm's all-reduce over ep (the experts' squares); with the balancing
    bias, the loads' all-reduce over dp (``bias_traffic``)."""
    require_positive_int("dp", dp)
    if dp % ep:
        raise ValueError(f"ep={ep} does not divide dp={dp}")
    dense, expert = rank_tensors(shape, ep)
    edp = dp // ep
    return [Transfer("dp", "all_reduce", dp, sum(dense) * elem_bytes, int(dp > 1),
                     "dense gradients (one flat buffer), then / dp"),
            Transfer("edp", "all_reduce", edp, sum(expert) * elem_bytes, int(edp > 1),
                     "expert gradients (one flat buffer), summed, then / dp")
            ] + norm_transfers({"ep": ep}, clip_grad) + bias_traffic(shape, dp, elem_bytes)


def bias_traffic(shape: Shape, dp: int, elem_bytes: int = 4) -> list[Transfer]:
    """The balancing bias's update (DeepSeek-V3 Sec. 2.1.2): the step's ``[L_moe, E]`` loads
    (float32) all-reduced over the dp ranks that route the global batch, once per step (none
    over one rank); no transfer without the bias."""
    if not shape.moe_bias_update_rate:
        return []
    return [Transfer("dp", "all_reduce", dp, shape.num_moe_layers * shape.num_experts
                     * elem_bytes, int(dp > 1), "expert loads for the balancing bias (sum)")]


def bias_state_bytes(shape: Shape, elem_bytes: int = 4) -> int:
    """The routers' balancing biases: E float32 per MoE layer (0 without the bias)."""
    return shape.num_moe_layers * shape.num_experts * elem_bytes \
        if shape.moe_bias_update_rate else 0


def rank_states(shape: Shape, ep: int, optimizer: str = "adamw", elem_bytes: int = 4
                ) -> dict[str, int]:
    """Model states of one rank: its dense and expert parameters, their gradients and AdamW's
    8 bytes per element plus a 4-byte step per tensor."""
    dense, expert = rank_tensors(shape, ep)
    out = flat_states(dense + expert, optimizer, elem_bytes)
    out["other"] += bias_state_bytes(shape)
    return out


class ExpertPrediction(RankPrediction):
    """One rank's step of ``expert.alltoall`` (every rank alike): its all-to-alls and
    gradient reductions, its dense and expert model states, the figures of
    :func:`expert_prediction`."""


def expert_prediction(model, *, ep: int, dp: int, micro_batch_size: int, num_microbatches: int = 1,
                      optimizer: str = "adamw", elem_bytes: int = 4,
                      clip_grad: float = 0.0) -> ExpertPrediction:
    """Everything one rank of ``expert.alltoall`` measures in one step (``model``: a
    ``Shape`` or any object with the reference model's fields)."""
    shape = _moe_shape(model)
    tr = alltoall_traffic(shape, ep, micro_batch_size, num_microbatches, elem_bytes)
    tr += gradient_traffic(shape, ep, dp, elem_bytes, clip_grad)
    tr = [t for t in tr if t.count and t.group_size > 1]
    dense, expert = rank_tensors(shape, ep)
    tokens = micro_batch_size * shape.s
    c = capacity(tokens, shape.num_experts, shape.moe_top_k, shape.moe_capacity_factor)
    msg = shape.num_experts * c * shape.h * elem_bytes
    figures = {
        "capacity": c, "tokens_per_group": tokens,
        "a2a_message_bytes": msg,
        "a2a_per_moe_layer_per_microbatch": 4 if ep > 1 else 0,
        "a2a_wire_bytes_per_moe_layer": as_number(4 * wire_factor("all_to_all", ep) * msg),
        "moe_layers": shape.num_moe_layers, "dense_params": sum(dense),
        "expert_params_per_rank": sum(expert), "edp": dp // ep,
        "transfers": [t.as_dict() for t in tr]}
    return ExpertPrediction(tr, rank_states(shape, ep, optimizer, elem_bytes), figures)
