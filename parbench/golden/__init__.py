"""The golden run: the unpartitioned model trained on one device, the committed golden files,
and the reference router's per-expert counts on the same data.

``run`` trains it (``train``, keyed by ``golden_key``), ``store`` serves it (``reference_run``:
a stored golden file when one was recorded, else trained here) and records and checks the
files, ``router_loads`` replays the golden run's parameters through the reference router. The
MoE routing groups are told by the caller (``Scheme.routing_groups``): the golden run looks
up no scheme.
"""
from .router_loads import reference_loads
from .run import GoldenRun, global_batch, golden_key, golden_name, reference_model, train
from .store import (GOLDEN_DIR, check, from_tensors, record, reference_run, sha256, stored,
                    to_tensors)

__all__ = ["GOLDEN_DIR", "GoldenRun", "check", "from_tensors", "global_batch", "golden_key",
           "golden_name", "record", "reference_loads", "reference_model", "reference_run",
           "sha256", "stored", "to_tensors", "train"]
