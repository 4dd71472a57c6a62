"""Pipeline parallelism in closed form: what each rank holds, sends and keeps in one step.

Pure functions of plain numbers and a :class:`Shape`; the placement is named by its kind
(``"linear"``, ``"looped"``, ``"v"``, ``"bidirectional"``, the values of
``parbench.schedules.Placement``), never read from a generated schedule, so these figures
check the schedules and the executor instead of restating them.

**Placements** (stage s of S, rank r of p, v chunks per rank):

* linear (GPipe, 1F1B, ZB-H1/H2, PipeDream, 2BW): S = p, stage r on rank r;
* looped (interleaved 1F1B, Narayanan et al. 2021 Sec. 2.2.2; looped BFS): S = p v, stage
  s on rank s mod p, so rank r holds stages r, r + p, ..., r + (v-1) p;
* V (ZB-V, Qi et al. 2024 Sec. 6; DualPipeV; V-Half and V-Min, Qi et al. 2024b): S = 2p,
  rank r holds stages r and 2p-1-r, so the hand-off between stages p-1 and p stays on rank
  p-1;
* wave (Hanayo, Liu et al. 2023 Sec. 3): S = p v, chunk c = s // p runs down the
  ranks (c even: stage c p + r on rank r) or back up (c odd: stage c p + p-1-r on rank r);
  every turn (stages c p + p-1 -> (c+1) p) stays on one rank (p-1 or 0); v = 2 is the V;
* bidirectional (Chimera, Li & Hoefler 2021 Sec. 3; DualPipe, DeepSeek-V3 report Sec.
  3.2.1): two replicas of S = p stages, the down pipe with stage s on rank s and the up pipe
  with stage s on rank p-1-s. Both papers feed half of the m micro-batches to each pipe
  (Chimera: D/2 per direction per basic unit; DualPipe: m/2 from each end), and each rank
  holds stage r of the down pipe and stage p-1-r of the up pipe.

**Traffic** (Narayanan et al. 2021, PTD-P Sec. 2.2 and 4.1; the TARGETS' "b s h per boundary
per micro-batch each way (x v interleaved)"): every micro-batch crosses every stage
boundary once forward (its activation) and once backward (the activation's gradient), each
one send of b s h elements; a boundary whose two stages share a rank is a local hand-off.
The two-replica schedules then add the two copies of every stage's gradient: one exchange
of each rank's flat gradients with its partner rank p-1-r (one send of both stages'
gradients, S = 2(n-1)/n S bytes at n = 2, the ring all-reduce volume). With tied
embeddings the first and last stages' copies of the word embedding add their gradients
over the embedding group (``tied_embedding_traffic``, on its own axis). With gradient
clipping by global norm (Pascanu et al. 2013; Megatron-LM's ``clip_grad_norm_fp32``, which
all-reduces the squared norm over the model-parallel group) each rank adds the squares of
its stages' gradients -- each parameter once: one replica of a two-replica schedule, one
copy of a tied embedding -- and the 4-byte sum is all-reduced over pp once per step
(``clip_spread``, ``analytic.clip``); the asynchronous rules do not clip.

**Model states** (the tracker's categories, fp32): the parameters of the stages a rank
holds (``stage_numel``: embedding on stage 0, final LN and head on stage S-1, L/S layers
each), one gradient per parameter, AdamW's two moments per parameter and one 4-byte step
counter per parameter *tensor* (``stage_tensors``). The asynchronous rules keep more weight
versions (``weight_versions``): PipeDream stashes one version per micro-batch in flight, p-s
on stage s counting the live one (Narayanan et al. 2019, Sec. 3.3), PipeDream-2BW two
(Narayanan et al. 2021, Sec. 3.1); and their continuous pipeline carries the activations of
the micro-batches still in flight from one step to the next (``carried_activation_bytes``).
"""
from __future__ import annotations

from typing import Sequence

from .params import (dense_block_tensor_sizes, embedding_params, head_params, layer_params,
                     norm_tensor_sizes)
from ..layout import chunk_range
from .shape import Shape, require_positive_int

PLACEMENTS = ("linear", "looped", "v", "bidirectional", "wave")
#: fp32 bytes per element: the pipeline family runs fp32
FP32 = 4


def _check_placement(placement: str) -> str:
    kind = str(placement)
    if kind not in PLACEMENTS:
        raise ValueError(f"placement={kind!r} must be one of {', '.join(PLACEMENTS)}")
    return kind


# ---- placement ---------------------------------------------------------------------------

def num_stages(placement: str, p: int, v: int = 1) -> int:
    """S: p (linear, bidirectional: each replica), p v (looped, wave), 2p (V)."""
    kind = _check_placement(placement)
    require_positive_int("p", p)
    require_positive_int("v", v)
    return {"linear": p, "looped": p * v, "v": 2 * p, "bidirectional": p, "wave": p * v}[kind]


def stages_on_rank(placement: str, p: int, rank: int, v: int = 1) -> list[tuple[int, int]]:
    """The (pipe, stage) pairs rank ``rank`` holds (see the module docstring)."""
    kind = _check_placement(placement)
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank} must be in [0, p={p})")
    if kind == "linear":
        return [(0, rank)]
    if kind == "looped":
        return [(0, c * p + rank) for c in range(v)]
    if kind == "v":
        return [(0, rank), (0, 2 * p - 1 - rank)]
    if kind == "wave":
        return [(0, c * p + (rank if c % 2 == 0 else p - 1 - rank)) for c in range(v)]
    return [(0, rank), (1, p - 1 - rank)]


# ---- parameters of a stage ---------------------------------------------------------------

def _layers_per_stage(shape: Shape, stages: int) -> int:
    require_positive_int("num_stages", stages)
    if shape.num_layers % stages:
        raise ValueError(f"num_stages={stages} does not divide num_layers={shape.num_layers}")
    return shape.num_layers // stages


def _stage_layers(shape: Shape, stages: int, stage: int,
                  chunks: Sequence[int] | None = None) -> range:
    """The global indices of the L/S layers stage ``stage`` of ``stages`` holds; ``chunks``:
    each stage's layers where they differ (uneven end ranks, ``Layout.chunk_layers``)."""
    if chunks is not None:
        return range(*chunk_range(chunks, shape.num_layers, stage))
    per = _layers_per_stage(shape, stages)
    return range(stage * per, (stage + 1) * per)


def stage_numel(shape: Shape, stages: int, stage: int,
                chunks: Sequence[int] | None = None) -> int:
    """Parameters of stage ``stage`` of ``stages``: its L/S layers (``layer_params``; an MoE
    layer only where ``Shape.is_moe_layer``), the embedding on stage 0 and the final LN and
    LM head on the last stage (a separate head: the pipeline stages do not share the
    embedding)."""
    out = sum(layer_params(shape, moe_layer=shape.is_moe_layer(i))
              for i in _stage_layers(shape, stages, stage, chunks))
    if stage == 0:
        out += embedding_params(shape)
    if stage == stages - 1:
        out += head_params(shape, separate_stage=stages > 1)
    return out


def layer_tensors(shape: Shape, moe_layer: bool | None = None) -> int:
    """Parameter tensors of one layer (``params.dense_block_tensor_sizes``): LN1, LN2
    (weight, bias each), QKV and projection (weight, bias each), and the MLP's two linears
    (weight, bias each) -- 12 dense for GPT-2, 7 for LLaMA (RMSNorm, no biases); an MoE
    layer has a router weight and E expert MLPs of 4 tensors instead of the MLP.
    ``moe_layer`` picks the kind (default: MoE when the model has experts)."""
    dense = len(dense_block_tensor_sizes(shape))
    mlp = 4 if shape.bias else 2
    moe = shape.moe if moe_layer is None else moe_layer
    return dense - mlp + (1 + mlp * shape.num_experts if moe else mlp)


def stage_tensors(shape: Shape, stages: int, stage: int,
                  chunks: Sequence[int] | None = None) -> int:
    """Parameter tensors of a stage (AdamW keeps one step counter per tensor): the layers'
    (``layer_tensors``, each of its kind), the token and position embeddings on stage 0, the
    final LN (2) and the untied head weight (1) on the last stage."""
    out = sum(layer_tensors(shape, shape.is_moe_layer(i))
              for i in _stage_layers(shape, stages, stage, chunks))
    if stage == 0:
        out += 1 + int(shape.position_embeddings)
    if stage == stages - 1:
        out += len(norm_tensor_sizes(shape)) + int(not shape.tie_embeddings or stages > 1)
    return out


def rank_numel(shape: Shape, placement: str, p: int, rank: int, v: int = 1,
               chunks: Sequence[int] | None = None) -> int:
    """Parameters held by a rank: the sum over the stages its placement gives it."""
    stages = num_stages(placement, p, v)
    return sum(stage_numel(shape, stages, s, chunks)
               for _, s in stages_on_rank(placement, p, rank, v))


def rank_tensors(shape: Shape, placement: str, p: int, rank: int, v: int = 1,
                 chunks: Sequence[int] | None = None) -> int:
    stages = num_stages(placement, p, v)
    return sum(stage_tensors(shape, stages, s, chunks)
               for _, s in stages_on_rank(placement, p, rank, v))


# ---- point-to-point traffic ---------------------------------------------------------------

def boundary_bytes(b: int, s: int, h: int, bytes_per_element: int = FP32) -> int:
    """One activation (or its gradient) at a stage boundary: b s h elements."""
    return b * s * h * bytes_per_element


def p2p_sends(placement: str, p: int, m: int, rank: int, v: int = 1) -> tuple[int, int]:
    """(activation sends, gradient sends) of ``rank`` in one synchronous step.

    linear: m forward unless r = p-1, m backward unless r = 0. looped: every boundary but
    the model's two ends crosses ranks (s -> s+1 is rank r -> r+1 mod p), so m v forward
    less m on rank p-1 (the last stage), m v backward less m on rank 0. V: stage r sends
    forward to rank r+1 unless r = p-1 (where stage p-1 -> p is local), stage 2p-1-r sends
    forward to rank r-1 unless r = 0 (the last stage); backward mirrors it. Bidirectional:
    each pipe carries m/2 micro-batches; the down pipe's stage r sends forward unless
    r = p-1, the up pipe's stage p-1-r (on rank r) unless r = 0, and backward the reverse.
    Wave: per chunk, the rank at the chunk's far end (p-1 going down, 0 going up) hands the
    activation on locally (a turn) or holds the last stage, every other rank sends it; the
    gradient likewise, from every rank but the chunk's near end.
    """
    kind = _check_placement(placement)
    require_positive_int("m", m)
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank} must be in [0, p={p})")
    if p == 1:
        return 0, 0
    not_last, not_first = int(rank < p - 1), int(rank > 0)
    if kind == "linear":
        return m * not_last, m * not_first
    if kind == "looped":
        return m * (v - 1 + not_last), m * (v - 1 + not_first)
    if kind == "wave":
        down, up = (v + 1) // 2, v // 2  # chunks running down (c even) and up (c odd)
        return (m * (down * not_last + up * not_first),
                m * (down * not_first + up * not_last))
    both = not_last + not_first
    if kind == "v":
        return m * both, m * both
    if m % 2:
        raise ValueError(f"m={m}: a bidirectional schedule feeds m/2 micro-batches to each "
                         "pipe (m must be even)")
    return m // 2 * both, m // 2 * both


def replica_exchange_numel(shape: Shape, p: int, rank: int) -> int:
    """Elements a rank of a two-replica schedule sends to synchronise gradients: the flat
    gradients of both stages it holds (stage r of the down pipe, p-1-r of the up pipe)."""
    return rank_numel(shape, "bidirectional", p, rank)


def tied_embedding_holder(placement: str, p: int, rank: int, v: int = 1) -> tuple[bool, bool]:
    """(holds a first stage, holds a last stage): what ``rank`` holds of a tied word
    embedding -- the embedding on stage 0, its copy as the output layer on stage S-1 -- over
    every pipe of the placement (``stages_on_rank``)."""
    stages = num_stages(placement, p, v)
    held = [s for _, s in stages_on_rank(placement, p, rank, v)]
    return 0 in held, stages - 1 in held


def tied_embedding_traffic(shape: Shape, placement: str, p: int, rank: int, v: int = 1, *,
                           bytes_per_element: int = FP32) -> tuple[int, int]:
    """(wire bytes, calls) of the tied word embedding's gradient synchronisation on one rank
    in one step (Megatron-LM's ``_allreduce_word_embedding_grads`` over the embedding group;
    Narayanan et al. 2021).

    With ``tie_embeddings`` and more than one stage, the first stage's embedding and the last
    stage's output layer are two copies of one V x h weight; their gradients are all-reduced
    over the embedding group -- the n = 2 ranks that hold exactly one of the two copies --
    once per step: 2(n-1)/n V h = V h elements sent per rank, one call. A rank that holds
    both copies (V: stages 0 and 2p-1 on rank 0; wave with even v; bidirectional: stage 0
    of one pipe beside stage p-1 of the other) adds them locally, and a rank that holds
    neither takes no part: 0 bytes, 0 calls."""
    if not shape.tie_embeddings or num_stages(placement, p, v) == 1:
        return 0, 0
    first, last = tied_embedding_holder(placement, p, rank, v)
    if first == last:
        return 0, 0
    n = 2
    numel = shape.V * shape.h
    return bytes_per_element * numel * 2 * (n - 1) // n, 1


def clip_spread(p: int) -> dict[str, int]:
    """The axes a pipeline's gradient is spread over, for the clipping norm's all-reduce
    (``analytic.clip.norm_transfers``): pp, each stage's gradients on one rank of p."""
    require_positive_int("p", p)
    return {"pp": p}


def step_traffic(shape: Shape, placement: str, p: int, m: int, rank: int, v: int = 1, *,
                 b: int, bytes_per_element: int = FP32) -> tuple[int, int]:
    """(wire bytes, send calls) of a rank in one synchronous step on axis pp."""
    fwd, bwd = p2p_sends(placement, p, m, rank, v)
    act = boundary_bytes(b, shape.s, shape.h, bytes_per_element)
    wire, calls = (fwd + bwd) * act, fwd + bwd
    if _check_placement(placement) == "bidirectional" and p > 1:
        wire += bytes_per_element * replica_exchange_numel(shape, p, rank)
        calls += 1
    return wire, calls


# ---- the continuous (asynchronous) 1F1B pipeline -------------------------------------------

def warmup(p: int, rank: int) -> int:
    """Micro-batches rank r runs forward ahead of its backwards in 1F1B: p-1-r (Narayanan et
    al. 2019, Sec. 3.2, "NOAM" = p in flight on the input stage)."""
    return p - 1 - rank


def backwards_done(p: int, m: int, rank: int, step: int, total_steps: int) -> int:
    """Backwards rank r has completed by the end of ``step`` in the continuous pipeline.

    Step t runs the forwards of its own micro-batches tm .. tm+m-1 and, in 1F1B order, the
    backwards lagging them by the warm-up p-1-r; the last step drains."""
    if step >= total_steps - 1:
        return total_steps * m
    return max(0, (step + 1) * m - warmup(p, rank))


def async_step_sends(p: int, m: int, rank: int, step: int, total_steps: int
                     ) -> tuple[int, int]:
    """(activation sends, gradient sends) of rank r in step ``step`` of the continuous
    linear pipeline: m activations (r < p-1), and the gradients of the backwards completed
    in that step (r > 0): m - (p-1-r) in the first step, m in steady state, m + (p-1-r) in
    the draining last step."""
    fwd = m * int(rank < p - 1)
    done = backwards_done(p, m, rank, step, total_steps)
    before = backwards_done(p, m, rank, step - 1, total_steps) if step else 0
    return fwd, (done - before) * int(rank > 0)


def async_in_flight(p: int, m: int, rank: int, step: int, total_steps: int) -> int:
    """Micro-batches rank r carries into the next step: forward done, backward not."""
    return (step + 1) * m - backwards_done(p, m, rank, step, total_steps) \
        if step < total_steps - 1 else 0


def carried_activation_bytes(p: int, m: int, rank: int, step: int, total_steps: int, *,
                             act_bytes: int) -> int:
    """Activation storages a rank keeps referenced for its carried micro-batches: the stage
    output (b s h) and, on stages after the first, the received input it differentiates
    with respect to (b s h). The last stage carries none (its warm-up is 0)."""
    per = act_bytes * (1 + int(rank > 0))
    return async_in_flight(p, m, rank, step, total_steps) * per


def weight_versions(rule: str, p: int, stage: int) -> int:
    """Weight copies a stage keeps: ``sync`` 1; ``pipedream`` p-s, one per micro-batch in
    flight at most (Narayanan et al. 2019, Sec. 3.3: stage s of p sees p-s minibatches in
    flight), the newest doubling as the optimizer's; ``2bw`` 2 (Narayanan et al. 2021, Sec.
    3.1: the version in-flight micro-batches use and the newest)."""
    if rule == "sync":
        return 1
    if rule == "pipedream":
        return p - stage
    if rule == "2bw":
        return 2
    raise ValueError(f"rule={rule!r} must be one of sync, pipedream, 2bw")


def model_states(shape: Shape, placement: str, p: int, rank: int, v: int = 1, *,
                 optimizer: str = "adamw", rule: str = "sync",
                 chunks: Sequence[int] | None = None) -> dict[str, int]:
    """Bytes by tracker category (params, grads, optimizer) of a rank after a step: fp32
    weights times ``weight_versions`` per stage, one gradient per parameter, AdamW's moments
    (8 bytes per parameter) and step counters (4 bytes per tensor)."""
    stages = num_stages(placement, p, v)
    held = [s for _, s in stages_on_rank(placement, p, rank, v)]
    numel = sum(stage_numel(shape, stages, s, chunks) for s in held)
    tensors = sum(stage_tensors(shape, stages, s, chunks) for s in held)
    params = sum(FP32 * weight_versions(rule, p, s) * stage_numel(shape, stages, s, chunks)
                 for s in held)
    opt = 2 * FP32 * numel + FP32 * tensors if optimizer == "adamw" else 0
    return {"params": params, "grads": FP32 * numel, "optimizer": opt, "other": 0}
