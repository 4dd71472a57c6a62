"""Localising a failure: a failing case's checked steps rerun on one rank with module probes
(issue 20, section 5; ``parbench.verdict.divergence`` says what is compared).

``probe_case`` builds the scheme as ``harness.run_case`` does and runs steps ``0 .. last`` --
no ledger, no timing, no memory peak: the case's own row is already measured -- recording,
at each step, what the scheme's mapped modules compute (``Scheme.module_probes``) and what
the golden model computes at the scheme's weights before the step. It returns this rank's
first divergence (``runner.localise`` takes the earliest over the ranks).
"""
from __future__ import annotations

import torch

from . import comm
from .config import CaseConfig
from .golden import global_batch
from .harness import get_mesh
from .registry import get_scheme
from .results import Divergence
from .scheme import SchemeContext
from .timeline import Timeline
from .verdict.checks import StepwiseGolden, completed
from .verdict.divergence import Recorder, first_divergence


def _weights(scheme, names) -> dict[str, torch.Tensor]:
    """The whole model's weights now (the scheme's, completed from the other ranks')."""
    with comm.unrecorded():
        mine = {n: t.detach().float().cpu().clone() for n, t in scheme.full_params().items()}
        return completed(mine, names, lambda m: m)


#: ``probe_case``'s answer for a rank whose scheme maps no module (nothing was compared)
UNMAPPED = "unmapped"


def probe_case(wctx, task: dict) -> Divergence | str | None:
    """This rank's first divergence over steps ``0 .. task["last"]`` of ``task["case"]``
    (None: every mapped module agrees; :data:`UNMAPPED`: this rank maps none, e.g. a
    framework baseline whose modules are its library's)."""
    case = CaseConfig.from_dict(task["case"])
    run = case.run
    torch.manual_seed(run.seed)
    cls = get_scheme(run.scheme)
    scheme = cls(SchemeContext(case=case, mesh=get_mesh(case, wctx.rank),
                               device=torch.device(wctx.device),
                               timeline=Timeline(wctx.rank, enabled=False)))
    probes = scheme.module_probes() or []
    if not probes:
        return UNMAPPED
    golden = StepwiseGolden(case, cls.routing_groups(case))
    golden_modules = dict(golden.model.named_modules())
    found = None
    for step in range(task["last"] + 1):
        wctx.progress(f"probing step {step}")
        x, y = global_batch(case, step)
        before = _weights(scheme, golden.params)
        ours = Recorder([(p.name, p.module) for p in probes])
        try:
            scheme.train_step(x, y, step)
        finally:
            ours.close()
        if found is not None or not probes or set(golden.params) - set(before):
            continue
        with wctx.working(f"golden modules of step {step}"):
            ref = Recorder([(p.name, golden_modules[p.name]) for p in probes
                            if p.name in golden_modules])
            try:
                golden.at(before, x, y)
            finally:
                ref.close()
            found = first_divergence(probes, ours, ref, run, step, wctx.rank)
    return found
