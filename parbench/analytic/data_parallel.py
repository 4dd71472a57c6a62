"""What the native data-parallel schemes must measure, from closed forms and stated rules.

Nothing here looks at a scheme's own objects: the parameter tensors come from the reference
model's architecture (``layer_tensors``, the table in ``params.py``), and the bucketing and
padding rules are stated and applied here.

Rules (the implementations in ``impls/data`` and ``impls/zero`` must follow them):

- **Buckets** (DDP; Li et al. 2020, "PyTorch Distributed", Sec. 3.2.3): parameter tensors in
  reverse model order are cut into buckets of at least ``cap = bucket_mb * 2^20 / e`` elements
  (e bytes per element); the last bucket takes the remainder.
- **Units** (ZeRO; Rajbhandari et al. 2020, Sec. 5 and 7): the same rule applied to whole
  layers (embedding, each block, head) instead of tensors; each unit is one flat buffer padded
  with zeros to a multiple of d, rank r owning ``ceil(Psi_u / d)`` elements of it.
- **Traffic per step** with m micro-batches: DDP all-reduces each bucket once, 2(d-1)/d Psi e
  (Sec. 3.2); ZeRO-1 reduce-scatters each unit once and all-gathers it after the step,
  2 Psi' (Sec. 7.2.1); ZeRO-2 reduce-scatters each unit every micro-batch, (m + 1) Psi';
  ZeRO-3 all-gathers each unit before its forward and its backward and reduce-scatters it in
  every micro-batch, 3 m Psi' (Sec. 7.2.2); with gradient clipping, one 4-byte all-reduce
  of the shards' squared norm (``analytic.clip``; DDP's replicated gradients need none); local SGD all-reduces all fp32 parameters on a
  sync step (Stich 2019). Psi' is the padded size, each message one whole unit.
- **Model states per rank** after a step (e = compute dtype bytes; AdamW keeps two fp32
  moments per element and one 4-byte ``step`` per parameter tensor it steps; with a lower
  compute precision the optimizer steps fp32 masters, counted with it as the ZeRO paper's
  K = 12 does): DDP, local SGD: Psi e params, Psi e grads, 8 Psi + 4 T optimizer; ZeRO-1:
  Psi' e params, Psi' e grads, shard optimizer; ZeRO-2: Psi' e params, shard e grads; ZeRO-3:
  shard e params and grads. Nothing else (``other``) is held between steps.
"""
from __future__ import annotations

from fractions import Fraction

from .clip import norm_transfers
from .comm import Transfer, summarize
from .memory import shard_numel
from .prediction import RankPrediction, adamw_bytes  # noqa: F401  (adamw_bytes re-exported)
from .params import dense_block_tensor_sizes, norm_tensor_sizes
from .shape import Shape

MiB = 2 ** 20


def layer_tensors(shape: Shape) -> list[tuple[str, list[int]]]:
    """The reference model's layers in forward order, each with its parameter tensors' sizes
    (see ``params.py``): embedding (tokens V h, learned positions s h), each block
    (``params.dense_block_tensor_sizes``: LN 2 x h, QKV 3h^2 + 3h, projection h^2 + h, LN
    2 x h, fc1 hf + f, fc2 fh + h for GPT-2), head (its norm, output V h unless tied).
    Dense models only."""
    if shape.moe:
        raise ValueError("layer_tensors: the data-parallel closed forms cover dense models")
    h, V = shape.h, shape.V  # noqa: N806
    embed = [V * h] + ([shape.s * h] if shape.position_embeddings else [])
    block = dense_block_tensor_sizes(shape)
    head = norm_tensor_sizes(shape) + ([] if shape.tie_embeddings else [V * h])
    return [("embed", embed)] + [(f"blocks.{i}", list(block)) for i in range(shape.l)] \
        + [("head", head)]


def bucket_sizes(sizes: list[int], cap_elems: int) -> list[list[int]]:
    """The bucket rule: indices in reverse order, cut when a bucket reaches ``cap_elems``."""
    buckets, cur, n = [], [], 0
    for i in reversed(range(len(sizes))):
        cur.append(i)
        n += sizes[i]
        if n >= cap_elems:
            buckets.append(cur)
            cur, n = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def cap_elements(bucket_mb: float, elem_bytes: int) -> int:
    return max(1, int(bucket_mb * MiB / elem_bytes))


class DataPrediction(RankPrediction):
    """One rank's step: transfers on axis dp (reported even when zero), and model-state bytes
    by category."""

    @property
    def wire_bytes(self) -> dict[str, float]:
        dp = summarize(self.transfers).get("dp")
        return {"dp": float(dp["wire_bytes"]) if dp else 0.0}

    @property
    def calls(self) -> dict[str, int]:
        return {"dp": sum(t.count for t in self.transfers if t.group_size > 1)}


def ddp(shape: Shape, dp: int, bucket_mb: float, elem_bytes: int = 4,
        optimizer: str = "adamw") -> DataPrediction:
    """Native DDP: one all-reduce per bucket per step, buckets by the bucket rule."""
    sizes = [n for _, ts in layer_tensors(shape) for n in ts]
    psi = sum(sizes)
    buckets = bucket_sizes(sizes, cap_elements(bucket_mb, elem_bytes))
    transfers = [Transfer("dp", "all_reduce", dp, sum(sizes[i] for i in b) * elem_bytes,
                          1 if dp > 1 else 0, "gradient bucket") for b in buckets]
    states = {"params": psi * elem_bytes, "grads": psi * elem_bytes,
              "optimizer": adamw_bytes(psi, len(sizes), optimizer), "other": 0}
    return DataPrediction(transfers, states, {"params": psi, "buckets": len(buckets)})


def zero_units(shape: Shape, dp: int, bucket_mb: float, elem_bytes: int) -> list[int]:
    """Unpadded elements of each unit, in forward order (layers grouped by the bucket rule)."""
    layers = [sum(ts) for _, ts in layer_tensors(shape)]
    groups = bucket_sizes(layers, cap_elements(bucket_mb, elem_bytes))
    return [sum(layers[i] for i in g) for g in reversed(groups)]


def zero(shape: Shape, dp: int, stage: int, bucket_mb: float, num_microbatches: int = 1,
         elem_bytes: int = 4, optimizer: str = "adamw", mixed: bool = False,
         clip_grad: float = 0.0) -> DataPrediction:
    """Native ZeRO stage 1, 2 or 3 (see the module docstring for the rules); with
    ``clip_grad``, the gradient norm's all-reduce over the shards' dp group
    (``analytic.clip``)."""
    units = zero_units(shape, dp, bucket_mb, elem_bytes)
    shards = [shard_numel(n, dp) for n in units]
    padded = [d * dp for d in shards]
    m = num_microbatches
    rs, ag_step, ag_use = {1: (1, 1, 0), 2: (m, 1, 0), 3: (m, 0, 2 * m)}[stage]
    live = 1 if dp > 1 else 0
    transfers = []
    for n in padded:
        msg = n * elem_bytes
        transfers.append(Transfer("dp", "reduce_scatter", dp, msg, rs * live, "gradients"))
        if ag_step:
            transfers.append(Transfer("dp", "all_gather", dp, msg, ag_step * live,
                                      "updated parameters"))
        if ag_use:
            transfers.append(Transfer("dp", "all_gather", dp, msg, ag_use * live,
                                      "parameters before use (forward and backward)"))
    transfers += norm_transfers({"dp": dp}, clip_grad)
    full, shard = sum(padded), sum(shards)
    e = elem_bytes
    opt = adamw_bytes(shard, len(units), optimizer) + (4 * shard if mixed else 0)
    states = {"params": (shard if stage == 3 else full) * e,
              "grads": (full if stage == 1 else shard) * e, "optimizer": opt, "other": 0}
    figures = {"params": sum(units), "padded_params": full, "shard_params": shard,
               "units": len(units)}
    return DataPrediction([t for t in transfers if t.count], states, figures)


def local_sgd_wire(shape: Shape, dp: int, period: int, step: int) -> float:
    """Local SGD: 2(d-1)/d x 4 Psi on a step s with (s + 1) % H == 0, else nothing."""
    psi = sum(n for _, ts in layer_tensors(shape) for n in ts)
    if (step + 1) % period or dp == 1:
        return 0.0
    return float(Fraction(2 * (dp - 1), dp) * 4 * psi)


def local_sgd(shape: Shape, dp: int, optimizer: str = "adamw") -> DataPrediction:
    sizes = [n for _, ts in layer_tensors(shape) for n in ts]
    psi = sum(sizes)
    transfers = [Transfer("dp", "all_reduce", dp, 4 * psi, 1 if dp > 1 else 0,
                          "parameters (sync steps only)")]
    states = {"params": 4 * psi, "grads": 4 * psi,
              "optimizer": adamw_bytes(psi, len(sizes), optimizer), "other": 0}
    return DataPrediction(transfers, states, {"params": psi})
