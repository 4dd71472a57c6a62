"""What the native ZeRO schemes predict (``parbench.analytic.data_parallel``, closed forms of
the unit rule), and the paper's accounting beside it for them and for the baselines."""
from __future__ import annotations

from fractions import Fraction

from parbench.analytic import data_parallel, shape_from
from parbench.analytic.comm import summarize, zero_traffic
from parbench.analytic.memory import (FP32_ADAMW, MIXED_ADAM, MIXED_ADAM_FP32_GRAD,
                                      zero_model_states)
from parbench.config import CaseConfig
from parbench.scheme import Prediction


def _elem_bytes(case: CaseConfig) -> int:
    return 2 if case.run.dtype == "bf16" else 4


def paper_figures(psi: int, dp: int, stage: int, elem_bytes: int, mixed: bool) -> dict:
    """The ZeRO paper's accounting beside ours (Rajbhandari et al. 2020, Sec. 5.1, Fig. 1;
    Sec. 7.2.1-7.2.2): model states per rank in (2 + 2 + K) Psi with K = 12, in the
    20-bytes-per-parameter accounting (K = 16, an fp32 gradient copy), and in the dtype this run
    uses (unpadded, AdamW ``step`` scalars not counted); traffic per step of the unpadded Psi in
    fp16 (2 bytes) and in the run's dtype, one micro-batch."""
    actual = MIXED_ADAM if mixed else FP32_ADAMW
    return {
        "psi": psi,
        "accountings": {"2+2+K, K=12 (fp16, mixed Adam)": "mixed_adam",
                        "20 bytes/param (fp32 grad copy, K=16)": "mixed_adam_fp32_grad",
                        "actual dtype": actual.name},
        "model_state_bytes": {
            "mixed_adam": zero_model_states(psi, dp, stage, MIXED_ADAM).as_dict(),
            "mixed_adam_fp32_grad": zero_model_states(psi, dp, stage,
                                                      MIXED_ADAM_FP32_GRAD).as_dict(),
            "actual_dtype": zero_model_states(psi, dp, stage, actual).as_dict(),
        },
        "wire_bytes": {
            "fp16": summarize(zero_traffic(psi, dp, stage, 2, pad=False)).get("dp", {}),
            "actual_dtype": summarize(zero_traffic(psi, dp, stage, elem_bytes,
                                                   pad=False)).get("dp", {}),
        },
    }


def zero_prediction(case: CaseConfig, stage: int) -> Prediction:
    """``predict()`` of the native ZeRO schemes: the unit rule's exact bytes and states."""
    e = _elem_bytes(case)
    mixed = case.run.dtype == "bf16"
    par = case.layout
    pred = data_parallel.zero(shape_from(case.model), par.dp, stage, case.options.data.bucket_mb,
                              par.num_microbatches, e, case.run.optimizer, mixed,
                              case.run.clip_grad)
    wire = summarize(pred.transfers).get("dp", {"message_bytes": 0, "count": 0})
    out = Prediction.uniform(
        par.dp, pred.wire_bytes, pred.states, pred.calls,
        message_bytes={"dp": wire["message_bytes"]},
        transfers=[t.as_dict() for t in pred.transfers], **pred.figures,
        paper=paper_figures(pred.figures["params"], par.dp, stage, e, mixed))
    out.paper_model_state_bytes = paper_states(pred.figures["params"], par.dp, stage)
    return out


def paper_states(psi: int, dp: int, stage: int) -> float:
    """One rank's model states in the ZeRO paper's accounting: (2 + 2 + K) Psi, K = 12,
    partitioned by ``stage`` (Rajbhandari et al. 2020, Sec. 5.1, Fig. 1)."""
    return zero_model_states(psi, dp, stage, MIXED_ADAM).total


def paper_prediction(case: CaseConfig, stage: int) -> Prediction:
    """``predict()`` of a baseline: the paper's accounting in the run's dtype (unpadded Psi,
    no AdamW step scalars), traffic repeated per micro-batch as the native scheme does it."""
    psi = data_parallel.ddp(shape_from(case.model), 1, 1.0).figures["params"]
    e = _elem_bytes(case)
    mixed = case.run.dtype == "bf16"
    d, m = case.layout.dp, case.layout.num_microbatches
    per = {1: 2, 2: m + 1, 3: 3 * m}[stage]
    ms = zero_model_states(psi, d, stage, MIXED_ADAM if mixed else FP32_ADAMW)
    out = Prediction.uniform(
        d, {"dp": float(Fraction(d - 1, d) * per * psi * e)},
        {"params": ms.param, "grads": ms.grad, "optimizer": ms.optim}, params=psi,
        paper=paper_figures(psi, d, stage, e, mixed))
    out.paper_model_state_bytes = paper_states(psi, d, stage)
    return out
