"""Is the layout PTD-P chose (Narayanan et al. 2021, Table 1) in ``parbench plan``'s top 3?

``python scripts/plan_ptdp.py [rows=1,2,3] [device=a100-80gb]``: one line per row
(``parbench.plan_ptdp``)."""
from __future__ import annotations

import sys

from parbench.plan_ptdp import check_row
from parbench.reproduce.ptdp import TABLE1


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv)
    rows = [int(r) for r in args.get("rows", ",".join(str(i + 1) for i in
                                                       range(len(TABLE1)))).split(",")]
    for row in rows:
        print(check_row(row, args.get("device", "a100-80gb")).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
