"""The hybrid's figure beside its rows: UB-Mesh Table 1 (arXiv 2503.20377) for a case."""
from __future__ import annotations

from parbench.reproduce import ubmesh_measured as table


def ubmesh_table(case, per_rank: list, out_dir, transfers: list) -> list:
    """Rank 0's measured ledger beside the closed form's ``transfers`` of rank 0 at this
    configuration and the traffic model at the paper's (``reproduce.ubmesh_measured``),
    written as ``ubmesh-table1.md`` in the results directory; none without a ledger."""
    r0 = next((r for r in per_rank if r.rank == 0), None)
    if r0 is None or not r0.ledger:
        return []
    p, o = case.layout, case.options
    config = (f"hybrid tp={p.tp} (recompute={o.recompute}, sp={o.tensor.sp}) cp={p.cp} "
              f"({o.context.cp_algorithm}) ep={p.ep} (top-{case.model.moe_top_k} of "
              f"{case.model.num_experts}) pp={p.pp} (m={p.num_microbatches}) dp={p.dp}, "
              f"{case.run.dtype}, model {case.model.name}")
    path = out_dir / "ubmesh-table1.md"
    path.write_text(table.render(table.measured(r0.ledger), table.modelled(transfers), 0,
                                 config))
    return [path]
