"""The golden run: the unpartitioned model trained on one device, the committed golden files,
and the reference router's per-expert counts on the same data.

``run`` trains it (``train``), ``key`` says what it depends on (``golden_key``: shared by
every case with the same reference, no step count), ``store`` serves it (``reference_run``: a
stored golden file when one holds its key, by prefix, else trained here) and records the
files, ``select`` chooses which of the suites' keys to record, ``check`` recomputes each file
under the verdict's noise rule, ``router_loads`` replays the golden run's parameters through
the reference router. The MoE routing groups are told by the caller
(``Scheme.routing_groups``): the golden run looks up no scheme.
"""
from .check import check
from .key import case_of_key, golden_key, golden_name
from .router_loads import reference_loads
from .run import GoldenRun, global_batch, reference_model, train
from .select import SELECTIONS, Wanted, main_key, select_runs
from .store import (GOLDEN_DIR, from_tensors, read_manifest, record, reference_run, sha256,
                    stored, to_tensors, torch_release)

__all__ = ["GOLDEN_DIR", "SELECTIONS", "GoldenRun", "Wanted", "case_of_key", "check",
           "from_tensors", "global_batch", "golden_key", "golden_name", "main_key",
           "read_manifest", "record", "reference_loads", "reference_model", "reference_run",
           "select_runs", "sha256", "stored", "to_tensors", "torch_release", "train"]
