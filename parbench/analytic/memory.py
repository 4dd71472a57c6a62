"""Model-state memory per data-parallel rank under ZeRO, and the largest model that fits.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", Sec. 3.1 and Sec. 5.1 / Figure 1: with Psi parameters, Nd data-parallel ranks and K
bytes of optimizer state per parameter (K = 12 for mixed-precision Adam: fp32 master weights,
momentum and variance), the model states per rank are

    baseline      (2 + 2 + K) Psi
    P_os          2 Psi + 2 Psi + K Psi / Nd
    P_os+g        2 Psi + (2 + K) Psi / Nd
    P_os+g+p      (2 + 2 + K) Psi / Nd.

Units: the paper's memory figures use GB = 10^9 bytes. Only that reading reproduces them:
Psi = 7.5e9, Nd = 64, K = 12 gives 120e9, 31.41e9, 16.64e9 and 1.875e9 bytes, printed
"120GB, 31.4GB, 16.6GB, 1.88" in Table 1 (Figure 1 rounds the last to "1.9GB"); in GiB they
would be 111.8, 29.2, 15.5 and 1.75. Table 2's maximum model sizes likewise use 32 GB = 32e9
bytes per V100 (2B parameters for the baseline: 32e9 / 16).

An :class:`Accounting` says how many bytes each parameter costs in each of the three states.
Five are provided (``accounting=`` of ``estimate`` takes the name or an alias); every figure
says which one it uses:

- ``MIXED_ADAM`` (2, 2, 12), alias ``zero16``: the paper's, fp16 parameter and gradient,
  K = 12 (16 bytes);
- ``MIXED_ADAM_FP32_GRAD`` (2, 2, 16), alias ``zero20``: 20 bytes per parameter, which also
  keeps an fp32 copy of the gradient for the optimizer step (as DeepSpeed's fp16 optimizers
  do); that copy belongs to the optimizer's partition, so it counts in the optimizer state
  (K = 16). It is Megatron-Core's "float16 param, float16 grads" row (20, distributed
  optimizer 4 + 16/d) and DeepSpeed's ZeRO-2 estimator (``estimate_zero2_model_states_mem_
  needs``: 4 Psi + 16 Psi / N) at ZeRO stage 1;
- ``FP32_ADAMW`` (4, 4, 8): parbench's fp32 runs with ``torch.optim.AdamW`` -- fp32
  parameter, fp32 gradient, exp_avg and exp_avg_sq (16 bytes per parameter; AdamW's scalar
  ``step`` per tensor is not counted);
- ``MEGATRON`` (2, 4, 12), name ``megatron``: Megatron-LM's bf16 training -- bf16 parameter
  2, fp32 main gradient 4 (the contiguous grad buffer, ``main_grad``), fp32 master parameter
  and Adam's two moments 12 (18 bytes). Megatron-Core's distributed optimizer shards only
  the 12 over the data-parallel ranks: 6 + 12/d, i.e. ZeRO stage 1 here (Megatron-Core
  developer guide, "Distributed Optimizer": "float16 param, fp32 grads: 18, 6 + 12/d";
  ``megatron/training/theoretical_memory_usage.py``: ``num_bytes_per_parameter = 18 if not
  args.use_distributed_optimizer else 6 + (12 / args.data_parallel_size)``). Stages 2 and 3
  are not Megatron's; here they would shard the gradient and the parameter as ZeRO does;
- ``DEEPSPEED18`` (2, 4, 12) with a 4-byte largest-layer buffer, name ``deepspeed18``:
  DeepSpeed's ZeRO-3 estimator (``deepspeed/runtime/zero/stage3.py``,
  ``estimate_zero3_model_states_mem_needs`` without offload: ``largest_layer_memory =
  4 * largest_layer_params``; ``gpu_mem = largest_layer_memory + 18 * total_params /
  total_gpus``). DeepSpeed states only the total of 18; the per-state split (fp16 parameter
  2, fp32 gradient partition 4, fp32 master and Adam 12) is parbench's attribution and
  matters only below stage 3, which DeepSpeed's estimator does not describe with 18 bytes.
  The buffer (the largest layer gathered whole, fp16 parameter and gradient) is added at
  ZeRO stage 3 only (:func:`deepspeed_zero3_model_states`; ``estimate`` adds it as
  ``buffer``).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import floor, log10
from typing import Union

from .shape import require_nonneg_int, require_positive, require_positive_int

ZERO_STAGES = (0, 1, 2, 3)
#: The paper's names for the stages.
STAGE_NAMES = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


@dataclass(frozen=True)
class Accounting:
    """Bytes per parameter of each model state; ``layer_buffer``: bytes per parameter of the
    largest layer, held whole under ZeRO stage 3 (DeepSpeed's estimator: 4)."""

    name: str
    param: int
    grad: int
    optim: int
    layer_buffer: int = 0

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optim


MIXED_ADAM = Accounting("mixed_adam", 2, 2, 12)
MIXED_ADAM_FP32_GRAD = Accounting("mixed_adam_fp32_grad", 2, 2, 16)
FP32_ADAMW = Accounting("fp32_adamw", 4, 4, 8)
MEGATRON = Accounting("megatron", 2, 4, 12)
DEEPSPEED18 = Accounting("deepspeed18", 2, 4, 12, layer_buffer=4)
ACCOUNTINGS = {a.name: a for a in (MIXED_ADAM, MIXED_ADAM_FP32_GRAD, FP32_ADAMW, MEGATRON,
                                   DEEPSPEED18)}
#: other names for the accountings: ZeRO's 16 bytes and the 20-byte one
ACCOUNTING_ALIASES = {"zero16": MIXED_ADAM.name, "zero20": MIXED_ADAM_FP32_GRAD.name}

AccountingLike = Union[Accounting, str]


def get_accounting(acc: AccountingLike) -> Accounting:
    """An :class:`Accounting` from itself, its name or an alias (``zero16``, ``zero20``)."""
    if isinstance(acc, Accounting):
        return acc
    acc = ACCOUNTING_ALIASES.get(acc, acc)
    if acc not in ACCOUNTINGS:
        names = [*ACCOUNTINGS, *ACCOUNTING_ALIASES]
        raise ValueError(f"accounting={acc!r} must be one of {', '.join(names)}")
    return ACCOUNTINGS[acc]


@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer states on one rank."""

    param: float
    grad: float
    optim: float

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optim

    def as_dict(self) -> dict[str, float]:
        return {"param": self.param, "grad": self.grad, "optim": self.optim,
                "total": self.total}


def _check(dp: int, stage: int) -> None:
    require_positive_int("dp", dp)
    require_nonneg_int("zero_stage", stage)
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={stage} must be one of 0, 1, 2, 3")


def partitioned(stage: int) -> tuple[bool, bool, bool]:
    """Which of (param, grad, optim) ZeRO ``stage`` partitions over the data-parallel ranks."""
    return stage >= 3, stage >= 2, stage >= 1


def zero_model_states(params: float, dp: int = 1, stage: int = 0,
                      accounting: AccountingLike = MIXED_ADAM) -> ModelStates:
    """The paper's per-rank model states (Rajbhandari et al. 2020, Sec. 5.1, Figure 1):
    each partitioned state costs ``bytes * Psi / Nd``, each replicated one ``bytes * Psi``."""
    _check(dp, stage)
    a = get_accounting(accounting)
    p, g, o = partitioned(stage)
    return ModelStates(param=a.param * params / (dp if p else 1),
                       grad=a.grad * params / (dp if g else 1),
                       optim=a.optim * params / (dp if o else 1))


def deepspeed_zero3_model_states(params: float, num_gpus: int,
                                 largest_layer_params: float) -> float:
    """DeepSpeed's ZeRO-3 estimate of model-state bytes per GPU without offload:
    ``4 * largest_layer_params + 18 * params / num_gpus`` (``deepspeed/runtime/zero/
    stage3.py``, ``estimate_zero3_model_states_mem_needs``, ``cpu_offload=False``; DeepSpeed
    truncates the second term to an integer)."""
    require_positive_int("num_gpus", num_gpus)
    return DEEPSPEED18.layer_buffer * largest_layer_params + 18 * params / num_gpus


def zero_bytes_per_param(dp: int, stage: int, accounting: AccountingLike = MIXED_ADAM,
                         mp: int = 1) -> float:
    """Model-state bytes per parameter on one rank, with model parallelism ``mp`` also
    dividing the model (ZeRO paper Table 2 combines ZeRO-DP with Megatron MP)."""
    require_positive_int("mp", mp)
    return zero_model_states(1, dp, stage, accounting).total / mp


def largest_model_fits(device_bytes: float, dp: int, stage: int,
                       accounting: AccountingLike = MIXED_ADAM, mp: int = 1) -> float:
    """Largest Psi whose model states fit in ``device_bytes`` per rank (ZeRO paper Table 2,
    left: e.g. 32e9-byte V100s, Nd = 64, MP = 1 give 2B, 7.6B, 14.4B and 128B parameters
    for the baseline, P_os, P_os+g and P_os+g+p). Activations and buffers are ignored, as in
    the paper's analysis."""
    require_positive("device_bytes", device_bytes)
    return device_bytes / zero_bytes_per_param(dp, stage, accounting, mp)


# ---------------------------------------------------------------------------------------
# exact flat-buffer partition
# ---------------------------------------------------------------------------------------

def shard_numel(numel: int, dp: int) -> int:
    """Elements per rank when a flat buffer of ``numel`` elements is padded to a multiple of
    ``dp`` and split evenly: ceil(numel / dp)."""
    require_nonneg_int("numel", numel)
    require_positive_int("dp", dp)
    return -(-numel // dp)


def shard_range(numel: int, dp: int, rank: int) -> tuple[int, int]:
    """The real (unpadded) elements ``[start, stop)`` of ``rank``'s shard of the flat buffer:
    shard ``r`` covers ``[r c, (r + 1) c)`` of the padded buffer, ``c = ceil(numel/dp)``,
    clipped to ``numel`` -- so the padding lies at the end, on the last rank(s)."""
    c = shard_numel(numel, dp)
    if not 0 <= rank < dp:
        raise ValueError(f"rank={rank} must be in [0, dp={dp})")
    start = min(rank * c, numel)
    return start, min(start + c, numel)


def zero_model_states_exact(numel: int, dp: int = 1, stage: int = 0,
                            accounting: AccountingLike = FP32_ADAMW,
                            rank: int = 0) -> dict[str, ModelStates]:
    """Exact per-rank model-state bytes for a flat buffer of ``numel`` parameters.

    Returns ``{"padded": ..., "unpadded": ...}``: ``padded`` gives each partitioned state
    ``ceil(numel/dp)`` elements (what every rank allocates when the buffer is padded),
    ``unpadded`` gives it only the real elements of ``rank``'s shard (:func:`shard_range`).
    Replicated states hold all ``numel`` elements in both. Steady-state figures: transient
    buffers (the full gradient during a ZeRO-2 backward, the gathered parameters of a
    ZeRO-3 layer) are not model states.
    """
    require_nonneg_int("numel", numel)
    _check(dp, stage)
    a = get_accounting(accounting)
    flags = partitioned(stage)
    start, stop = shard_range(numel, dp, rank)
    out = {}
    for key, part_n in (("padded", shard_numel(numel, dp)), ("unpadded", stop - start)):
        n = [part_n if f else numel for f in flags]
        out[key] = ModelStates(param=a.param * n[0], grad=a.grad * n[1], optim=a.optim * n[2])
    return out


def zero_table(params: float, dp: int,
               accounting: AccountingLike = MIXED_ADAM) -> dict[str, float]:
    """Model-state bytes per rank for every stage, keyed by the paper's stage names."""
    return {STAGE_NAMES[st]: zero_model_states(params, dp, st, accounting).total
            for st in ZERO_STAGES}


def round_sig(x: float, sig: int = 3) -> float:
    """Round to ``sig`` significant figures, as the ZeRO paper prints its GB figures."""
    if x == 0:
        return 0.0
    return round(x, sig - 1 - int(floor(log10(abs(x)))))


def kv_cache_bytes(b: int, l: int, h: int, s: int, n: int,  # noqa: E741
                   bytes_per_element: int = 2, kv_hidden: int | None = None) -> int:
    """KV cache for b sequences of s prompt and n generated tokens: each of the l layers keeps
    K and V of every token, b(s+n)h elements each -- 4 b l h (s + n) bytes in fp16
    (2 tensors x 2 bytes). With grouped-query attention K and V have ``kv_hidden`` =
    num_kv_heads x head size columns instead of h (Ainslie et al. 2023, "GQA", Sec. 2.2: the
    KV cache shrinks by num_heads / num_kv_heads): 4 b l h_kv (s + n) bytes."""
    kv = h if kv_hidden is None else kv_hidden
    return 2 * bytes_per_element * b * l * kv * (s + n)
