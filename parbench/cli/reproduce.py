"""``parbench reproduce NAME|all [out=DIR]``: published tables beside the tool's figures.

Each NAME is a module of :mod:`parbench.reproduce`; ``all`` runs every one. Each writes
``DIR/NAME.md`` (default ``results/reference``; ``out=-`` prints the markdown instead) and
prints one summary line "N of M cells within X%". Exit status: 0 when every cell is within its
table's tolerance or outside it for a stated cause (a printing error in the paper), 3 when a
cell is off for no known cause, 2 on bad input. A goal table's misses (``throughput``: the time
model against published runs) are printed as misses and leave the status alone (an unknown NAME: one line naming the known
ones).

``parbench run suite=papers [out=DIR]`` is the same as ``parbench reproduce all``: the papers
are not a suite of cases on ranks, so :func:`run_papers_suite` answers it before the suite
runner looks for ``suites/papers.yaml``.
"""
from __future__ import annotations

import json
import sys

from ..overrides import parse_overrides
from .output import UsageError

DEFAULT_OUT = "results/reference"
#: exit status when a cell is off for no known cause (as ``run`` / ``verify`` use 3)
EXIT_MISS = 3


def _names(positional: list[str]) -> list[str]:
    from ..reproduce import names
    known = names()
    if not positional:
        raise UsageError(f"reproduce needs a NAME (choose from {', '.join(known)}, all)")
    if "all" in positional:
        if len(positional) > 1:
            raise UsageError("reproduce all takes no other NAME")
        return known
    for name in positional:
        if name not in known:
            raise UsageError(f"reproduce: NAME={name!r} is not known (choose from "
                             f"{', '.join(known)}, all)")
    return list(dict.fromkeys(positional))


def _options(keyed: list[str]) -> str:
    ov = parse_overrides(keyed)
    out = ov.pop("out", DEFAULT_OUT)
    if not out:
        raise UsageError("out= needs a directory (or out=- to print the markdown)")
    if ov:
        raise UsageError(f"unknown key {next(iter(ov))!r} for reproduce (out=DIR)")
    return out


def _report(r, path) -> None:
    where = f"  -> {path}" if path else ""
    print(f"{r.name:<12} {r.summary()}{where}")
    for t in r.tables:
        for c in t.cells:
            if c.within(t.tolerance):
                continue
            kind = "known cause" if c.explained else "MISS (goal)" if t.goal else "MISS"
            print(f"    {kind}: {t.key}: {c.label}: published {c.published:g}, tool "
                  f"{c.tool:.6g} {c.unit}".rstrip() + (f" -- {c.note}" if c.note else ""))


def reproduce(names: list[str], out: str, as_json: bool = False) -> int:
    """Run the reproductions ``names``, write or print them; the exit status."""
    from ..reproduce import render_markdown, run, write_markdown

    results, ok = [], True
    for name in names:
        r = run(name)
        ok = ok and r.ok
        path = None
        if out == "-":
            if not as_json:
                sys.stdout.write(render_markdown(r) + "\n")
        else:
            path = write_markdown(r, out)
        results.append((r, path))
        if not as_json and out != "-":
            _report(r, path)
    if as_json:
        print(json.dumps([{**r.to_dict(), "path": str(p) if p else None} for r, p in results],
                         indent=2, default=str))
    return 0 if ok else EXIT_MISS


def cmd_reproduce(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    positional = [a for a in args if "=" not in a]
    keyed = [a for a in args if "=" in a]
    names = _names(positional)
    return reproduce(names, _options(keyed), as_json)


def _is_papers_suite(args: list[str]) -> bool:
    for a in args:
        k, sep, v = a.partition("=")
        if sep and k.strip() == "suite" and v.strip() == "papers":
            return True
    return False


def run_papers_suite(args: list[str], as_json: bool = False) -> int | None:
    """``parbench run suite=papers [out=DIR]``: ``reproduce all``; None for any other suite."""
    if not _is_papers_suite(args):
        return None
    ov = parse_overrides(args)
    ov.pop("suite")
    extra = [k for k in ov if k != "out"]
    if extra:
        raise UsageError(f"suite=papers takes only out=DIR ({extra[0]!r} given): it runs "
                         "`parbench reproduce all`, the published tables, on no ranks")
    from ..reproduce import names
    return reproduce(names(), _options([f"out={ov['out']}"] if "out" in ov else []), as_json)
