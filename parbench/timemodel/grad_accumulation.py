"""The gradient-accumulation pass of one micro-batch on one virtual stage (time model).

How a micro-batch's weight gradient reaches the rank's gradient buffer (``Training``'s
``grad_accumulation``):

- ``fused``: the weight-gradient GEMM accumulates into the buffer itself (its C operand,
  beta = 1): Megatron-LM's ``gradient_accumulation_fusion`` (Korthikanti et al. 2022 ran
  Megatron-LM with it); no pass of its own -- the default, and the pricing before this rule;
- ``unfused``: the GEMM writes a fresh gradient and a separate elementwise add folds it into
  the buffer: Megatron-LM's local DDP in 2021 (its backward hook adds each parameter's
  ``grad`` into ``main_grad``; the SC21 runs of Narayanan et al. 2021, NGC PyTorch 20.12),
  and autograd's gradient accumulation. Every micro-batch pays the add over every parameter
  element of the stage: the buffer read, the gradient read, the buffer written, 3 e bytes
  an element over the memory bandwidth (autograd's first micro-batch can skip it: the rule
  over-counts by one add per step).
"""
from __future__ import annotations

from ..analytic import params as aparams
from .costs import _e, _param_shape
from .profile import Profile
from .training import Training

MODES = ("fused", "unfused")


def stage_params(shape, trn: Training, n_dense: int, n_moe: int, first: bool,
                 last: bool) -> int:
    """Parameter elements one rank of a virtual stage holds: its dense and MoE layers, the
    embedding on the first stage, the final norm and (untied, or on its own stage) the LM
    head on the last (``analytic.params``, vocabulary padded to tp)."""
    lay = trn.layout
    tp = lay.tp
    ps = _param_shape(shape, tp)
    n = 0
    if n_dense:
        n += n_dense * aparams.layer_params(ps, tp, lay.ep, etp=lay.etp, moe_layer=False)
    if n_moe:
        n += n_moe * aparams.layer_params(ps, tp, lay.ep, etp=lay.etp, moe_layer=True)
    if first:
        n += aparams.embedding_params(ps, tp)
    if last:
        n += aparams.head_params(ps, tp, separate_stage=lay.pp > 1)
    return n


def accumulation_s(shape, trn: Training, profile: Profile, n_dense: int, n_moe: int,
                   first: bool, last: bool) -> float:
    """Seconds of one micro-batch's accumulation pass on a virtual stage (module doc): 0
    when fused, else 3 e bytes per parameter element over the memory bandwidth."""
    if trn.grad_accumulation != "unfused":
        return 0.0
    n = stage_params(shape, trn, n_dense, n_moe, first, last)
    return profile.mem_time(3 * _e(trn.dtype) * n, 0)
