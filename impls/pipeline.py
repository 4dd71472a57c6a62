"""Registers ``pipeline.<name>`` for every schedule of ``parbench.schedules``.

The pieces: ``pipeline_scheme`` (the synchronous scheme: stages, replicas, prediction),
``pipeline_exec`` (the executor), ``pipeline_split`` (zero-bubble B/W split),
``pipeline_async`` (PipeDream weight stashing and PipeDream-2BW double buffering, with their
single-device references) and ``pipeline_metrics`` (bubble figures).
"""
from __future__ import annotations

from parbench.scheme import register

from .pipeline_async import PipeDreamScheme, TwoBWScheme
from .pipeline_scheme import SCHEDULE_NAMES, PipelineScheme

_BASES = {"pipedream": PipeDreamScheme, "2bw": TwoBWScheme}
DESCRIPTIONS = {
    "gpipe": "GPipe (Huang et al. 2019): all forwards, then all backwards",
    "1f1b": "1F1B / PipeDream-Flush (Narayanan et al. 2021), DAPPLE (Fan et al. 2021)",
    "interleaved": "interleaved 1F1B, v chunks per rank (Narayanan et al. 2021, PTD-P)",
    "zb-h1": "ZB-H1 (Qi et al. 2024): split B/W, W passes delayed",
    "zb-h2": "ZB-H2 (Qi et al. 2024): extra warm-up forwards, parallelogram",
    "zbv": "ZB-V (Qi et al. 2024): V placement, two stages per rank, split B/W",
    "chimera": "Chimera (Li & Hoefler 2021): two bidirectional replicas, grads synced",
    "dualpipe": "DualPipe (DeepSeek-V3 report): two replicas fed from both ends",
    "dualpipev": "DualPipeV: DualPipe cut in half, V placement",
    "bfs": "looped breadth-first (Lamy-Poirier 2023)",
    "pipedream": "PipeDream (Narayanan et al. 2019): async 1F1B, weight stashing",
    "2bw": "PipeDream-2BW (Narayanan et al. 2021): double-buffered weights, 1-step delay",
}


def _register_all() -> dict[str, type]:
    out = {}
    for name in SCHEDULE_NAMES:
        base = _BASES.get(name, PipelineScheme)
        cls = type(f"Pipeline_{name.replace('-', '_')}", (base,), {
            "name": f"pipeline.{name}", "schedule_name": name,
            "description": DESCRIPTIONS[name],
            "__module__": __name__})
        out[name] = register(cls)
        globals()[cls.__name__] = cls  # picklable by reference
    return out


SCHEMES = _register_all()
