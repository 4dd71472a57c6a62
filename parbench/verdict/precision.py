"""Tolerances of a bf16 row, derived from the rounding noise of each checked step.

A bf16 scheme cannot match an fp32 reference more closely than bf16 arithmetic allows, and a
stated tolerance loose enough for the noisiest tensor (rtol 5e-2, atol 1e-2) hides whole
errors in the small ones: a gradient tensor of scale 1e-3 fits inside atol 1e-2 whatever its
values. Instead each checked step measures the noise it must allow. The reference model at
the scheme's own weights (``StepwiseGolden``) runs the step's global batch twice: in fp32 and
in the scheme's compute dtype (parameters, activations and gradients rounded to bf16, as the
single-device mixed-precision step of Micikevicius et al. 2018, Sec. 3). Their difference,
tensor by tensor, is what bf16 rounding alone does to that tensor at that step. A correct
scheme's difference from the fp32 reference is another draw of the same rounding: the same
operations on other partitions and in another summation order, whose error bound differs
only by constants (Higham 2002, Ch. 4, the error of summation). The tolerance of tensor t:

    tol_t = NOISE_FACTOR * max|x_bf16,t - x_fp32,t| + UNIT_ROUNDOFF * max|x_fp32,t|

- ``NOISE_FACTOR`` = 4: two draws of the noise differ by up to the sum of their magnitudes
  (a factor 2), and the largest element of another draw may exceed this one's (another 2).
- ``UNIT_ROUNDOFF`` = 2^-8, bf16's unit roundoff (8 significant bits): a value that is held in
  bf16 lies that far from its fp32 value at the tensor's scale whatever else happens, so a
  tensor whose bf16 reference happened to round exactly is not held tighter than bf16 holds.

The row records the largest relative tolerance of any tensor (``detectable_grad_error``):
an error of that fraction of a tensor's scale is caught on every tensor of every step.
Parameters after the optimizer are fp32 masters and are judged by the update check (a few
ulps). After the timed steps they are compared with the shadow continued in the compute dtype
(``verdict.final``) to the same rule applied to the continuation
(:func:`final_tolerances`): the shadow is continued twice from the same state, in the compute
dtype and in fp32, and their difference per tensor is one draw of the timed steps' rounding
noise as AdamW carries it. The noise grows with the number of timed steps: AdamW's
normalised update moves an element whose gradient is within the noise by up to lr per step
(Kingma & Ba 2015, Sec. 2.1), in a direction the rounding sets, so two runs drift apart
step after step. Measured on the data suite's zero.1 row (dp=2, the scheme against the bf16
continuation, largest over tensors): 1.7e-3 after 3 timed steps, 7.2e-3 after 12, 1.7e-2
after 24, close to linear (x4.2 for x4 steps, x10 for x8) rather than sqrt(steps) (x2, x2.8;
with dp=2 every scheme sums the same two terms, so DeepSpeed ZeRO-1 and FSDP2 show the
same figures), so a
stated ``param_atol`` right for 3 steps (6e-3) fails a correct scheme after 12. The derived
tolerance needs no scaling law: its noise is measured over the very steps taken.
"""
from __future__ import annotations

import torch

NOISE_FACTOR = 4.0
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

#: how the row describes the rule
RULE = ("losses and gradients: 4 x |bf16 - fp32 reference| + 2^-8 x scale, per tensor "
        "and step; final parameters: the same over the timed steps' continuation")


def tolerances(low: dict[str, torch.Tensor], high: dict[str, torch.Tensor],
               dtype: torch.dtype) -> dict[str, float]:
    """Per tensor, the derived tolerance (module docstring) from the reference in the compute
    dtype (``low``) and in fp32 (``high``)."""
    u = UNIT_ROUNDOFF[dtype]
    out = {}
    for name, h in high.items():
        h64 = h.detach().to(torch.float64)
        noise = float((low[name].detach().to(torch.float64) - h64).abs().max()) \
            if h.numel() else 0.0
        scale = float(h64.abs().max()) if h.numel() else 0.0
        out[name] = NOISE_FACTOR * noise + u * scale
    return out


def loss_tolerance(low: float, high: float, dtype: torch.dtype) -> float:
    """The loss's derived tolerance (the same rule on one number)."""
    return NOISE_FACTOR * abs(low - high) + UNIT_ROUNDOFF[dtype] * abs(high)


def relative(tols: dict[str, float], ref: dict[str, torch.Tensor]) -> float:
    """The largest tolerance relative to its tensor's scale: the fraction of a tensor's
    scale that an error must reach to be caught on every tensor."""
    worst = 0.0
    for name, tol in tols.items():
        scale = float(ref[name].detach().abs().max()) if ref[name].numel() else 0.0
        if scale > 0:
            worst = max(worst, tol / scale)
    return worst


def final_tolerances(low: dict[str, torch.Tensor], high: dict[str, torch.Tensor],
                     dtype: torch.dtype, steps: int) -> dict[str, float]:
    """Per parameter (and model state), the final check's derived tolerance (module
    docstring): the continuation in the compute dtype (``low``) and in fp32 (``high``) from
    the same state over the ``steps`` timed steps; the rule of :func:`tolerances`. ``steps``
    < 1 is refused: there is no continuation to measure."""
    if steps < 1:
        raise ValueError(f"final tolerances need at least one timed step, got {steps}")
    return tolerances(low, {n: high[n] for n in low if n in high}, dtype)
