"""BPipe's prediction: 1F1B's closed forms (``prediction``) plus the evict and load axes of
``parbench.analytic.pipeline_bpipe`` (Kim et al. 2023, Sec. 3: evicted micro-batches times
one micro-batch's saved activations on the evictor's stage)."""
from __future__ import annotations

from parbench.analytic import pipeline_bpipe as closed
from parbench.analytic.shape import shape_from
from parbench.config import CaseConfig
from parbench.scheme import Prediction

from .prediction import pipeline_prediction


def bpipe_prediction(case: CaseConfig) -> Prediction:
    pred = pipeline_prediction(case, "bpipe")
    par, shape = case.layout, shape_from(case.model)
    p, m, b = par.pp, par.num_microbatches, par.micro_batch_size
    for r in range(p):
        for axis, (nbytes, calls) in closed.pair_traffic(shape, p, m, r, b).items():
            pred.wire_bytes[r][axis] = float(nbytes)
            pred.calls[r][axis] = calls
    pred.figures["bpipe"] = {
        "threshold": closed.threshold(p),
        "evicted_per_stage": [closed.evicted_count(p, m, s) for s in range(p)],
        "saved_bytes_per_microbatch": [closed.saved_bytes_per_microbatch(shape, b, p, s)
                                       for s in range(p - 1)],
        "peak_microbatches_1f1b": [closed.peak_resident(p, m, s, bpipe=False)
                                   for s in range(p)],
        "peak_microbatches_evictors": [closed.peak_resident(p, m, s) for s in range(p)],
    }
    return pred
