"""Is the layout PTD-P chose in the planner's top 3? (issue 22, sec. 2)

Narayanan et al. 2021 (SC21, arXiv 2104.04473), Table 1: for each GPT model (heads, hidden
size, layers; V = 51,200, s = 2,048, Sec. 5.1) the tensor- and pipeline-parallel sizes
(t, p) they trained with on n GPUs at global batch B; d = n / (t p). The planner is asked for
the same model, world and batch (its own space: every schedule, ZeRO stage, recomputation,
cp and micro-batch size the rules accept) and its top 3 are compared with the paper's
(t, p, d). Nothing here is tuned to make the answer yes: a row that misses reports the
planner's pick and the paper's layout as the planner prices it (its rank among the layouts
that fit, or why it does not fit).

``python scripts/plan_ptdp.py [rows=1,2,...] [device=a100-80gb]`` prints the table.
"""
from __future__ import annotations

from dataclasses import dataclass

from .analytic.shape import Shape
from .plan import Space, plan
from .reproduce.ptdp import TABLE1, gpt_shape
from .timemodel import Training, load_profile


@dataclass(frozen=True)
class PtdpCheck:
    """One Table 1 row against the planner."""

    row: int
    params_b: str
    world: int
    batch: int
    paper: tuple[int, int, int]  # (t, p, d)
    top: list  # the planner's top layouts, (t, cp, p, d, schedule, zero, recompute, b, step)
    in_top3: bool
    paper_rank: int | None  # the paper's (t, p, d) best rank among all fitting layouts
    ranked: int

    def line(self) -> str:
        t, p, d = self.paper
        tops = "; ".join(f"t{x[0]} cp{x[1]} p{x[2]} d{x[3]} {x[4]} z{x[5]} {x[6]} b{x[7]} "
                         f"{x[8]:.3g}s" for x in self.top[:3])
        where = (f"rank {self.paper_rank} of {self.ranked}" if self.paper_rank
                 else f"not among the {self.ranked} fastest that fit")
        return (f"row {self.row} ({self.params_b}B, n={self.world}, B={self.batch}): paper "
                f"(t,p,d)=({t},{p},{d}) {'IN' if self.in_top3 else 'NOT in'} top 3 "
                f"({where}); planner: {tops}")


def row_shape(row: int) -> Shape:
    """Table 1 row ``row`` (1-based) as a model shape (:func:`~.reproduce.ptdp.gpt_shape`)."""
    _, a, h, l, *_ = TABLE1[row - 1]  # noqa: E741
    return gpt_shape(a, h, l)


def check_row(row: int, device: str = "a100-80gb", keep: int = 50,
              space: Space = Space()) -> PtdpCheck:
    """The planner's top list for Table 1 row ``row`` and where the paper's (t, p, d) is."""
    printed, _, _, _, t, p, n, batch, _ = TABLE1[row - 1]
    res = plan(row_shape(row), n, load_profile(device), batch, space, keep=keep,
               base=Training())
    top = [(x.layout.tp, x.layout.cp, x.layout.pp, x.layout.dp, x.layout.schedule,
            x.options.data.zero_stage, x.options.recompute, x.layout.micro_batch_size,
            st.step_s) for x, st in res.ranked]
    paper = (t, p, n // (t * p))
    ranks = [i for i, x in enumerate(top, 1) if (x[0], x[2], x[3]) == paper and x[1] == 1]
    return PtdpCheck(row, printed, n, batch, paper, top, bool(ranks and ranks[0] <= 3),
                     ranks[0] if ranks else None, len(top))
