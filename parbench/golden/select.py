"""Which golden runs to record: the suites' golden keys, grouped.

A golden file costs one float32 copy of the model per step (``store``), and serving one
saves a rank only the golden run's own forward and backward passes (tens of milliseconds on
the suites' tiny models), so not every key earns a file. ``keys=main`` (the default) records,
for each suite, the key that most of its cases share (ties: the key serving most cases),
which serves most rows of every suite and pins the reference numbers of each kind of model
the suites run (dense, MoE with its routing groups, the deeper pipeline and hybrid models)
against a torch upgrade (``check``); ``keys=all`` records every key. The caller hands the
cases in (the golden package reads no suite and no scheme).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import CaseConfig
from ..model.moe import RoutingGroups
from .key import golden_key

SELECTIONS = ("main", "all")


@dataclass
class Wanted:
    """One golden run to record: its key, a case and routing groups that make it, the steps
    (the most any of its cases checks) and the cases it serves (``suite/case id``)."""

    key: str
    case: CaseConfig
    routing: RoutingGroups | None
    steps: int = 0
    cases: list[str] = field(default_factory=list)


def group(cases_by_suite: dict[str, list[CaseConfig]],
          routing_of: Callable[[CaseConfig], RoutingGroups | None]) -> dict[str, Wanted]:
    """Every golden key of the suites' cases (key -> what it serves)."""
    out: dict[str, Wanted] = {}
    for suite, cases in cases_by_suite.items():
        for case in cases:
            routing = routing_of(case) if case.model.num_experts else None
            key = golden_key(case, routing)
            w = out.setdefault(key, Wanted(key, case, routing))
            w.steps = max(w.steps, case.run.steps)
            w.cases.append(f"{suite}/{case.id}")
    return out


def main_key(suite: str, groups: dict[str, Wanted]) -> str | None:
    """The key that most of ``suite``'s cases share (ties: the one serving the most cases
    of all suites, then the first in sorted order; None: the suite has no case)."""
    counts = Counter({k: sum(c.startswith(f"{suite}/") for c in w.cases)
                      for k, w in groups.items()})
    best = sorted((k for k in counts if counts[k]),
                  key=lambda k: (-counts[k], -len(groups[k].cases), k))
    return best[0] if best else None


def select_runs(cases_by_suite: dict[str, list[CaseConfig]],
           routing_of: Callable[[CaseConfig], RoutingGroups | None],
           keys: str = "main") -> list[Wanted]:
    """The runs to record for ``cases_by_suite`` (suite -> the cases that use the standard
    golden run): each suite's main key (``keys=main``) or every key (``keys=all``)."""
    if keys not in SELECTIONS:
        raise ValueError(f"keys={keys!r} must be one of {', '.join(SELECTIONS)}")
    groups = group(cases_by_suite, routing_of)
    if keys == "all":
        chosen = set(groups)
    else:
        chosen = {main_key(s, groups) for s in cases_by_suite} - {None}
    return [groups[k] for k in sorted(chosen)]
