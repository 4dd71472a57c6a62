"""Every "ours / baseline" pair the suites hold, side by side in one run, and the instruments'
cost per native scheme (issue 24): ratio (< 1: ours faster), its spread over the repeats,
repeats, both medians and the case. ``--json FILE`` also writes the figures; ``parbench compare
OLD.json NEW.json`` gates two such files pair by pair (``parbench.report.bench_compare``).

    python scripts/bench_all.py [suites=data,tensor] [repeats=5] [timed_steps=12]
                                [only=zero.3] [instruments=true|false|only] [above=EARLIER.json]
                                [model=small ...] [--json FILE]

Pairs come from the suites (``parbench.bench_pairs``): each baseline row beside the same case
run by its native scheme (``above=EARLIER.json``: only the baseline pairs an earlier run
measured above 1.00x, e.g. again with more repeats). Each pair alternates ours and theirs
``repeats`` times on one pool per world size; one thread per rank. Beside each wall-clock ratio, the ratio of the ranks' CPU
seconds per step (the work each side does). The last lines count what is above issue 24's goals
(baseline pairs above 1.00x with no stated reason, instrument pairs above 1.03x). No assertion:
this prints what one run measured.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parbench.bench import alternate  # noqa: E402
from parbench.bench_ab import summarise_ab  # noqa: E402
from parbench.bench_pairs import (case_key, failed, goals, instrument_pairs,  # noqa: E402
                                  suite_pairs, summarise)
from parbench.overrides import apply_overrides, parse_overrides  # noqa: E402
from parbench.terminate import run_terminable  # noqa: E402


OWN_KEYS = ("suites", "repeats", "timed_steps", "only", "instruments", "above")


def _with_steps(pair, timed: int, fields: dict):
    """The pair with the benchmark's timed steps and the command line's case fields (both
    sides alike, e.g. ``model=small``)."""
    for side in ("ours", "theirs"):
        case = apply_overrides(getattr(pair, side), fields) if fields else getattr(pair, side)
        setattr(pair, side, replace(case, run=replace(case.run, timed_steps=timed)))
    return pair


def measure(pair, repeats: int):
    """A baseline pair: ours and theirs alternately, ``repeats`` times each; an instrument
    pair: its one case (timed steps alternating the instruments) ``repeats`` times, with
    four times the timed steps (the effect sought is a few percent)."""
    if pair.kind == "instrument":
        case = pair.ours
        case = replace(case, run=replace(case.run, timed_steps=4 * case.run.timed_steps))
        return summarise_ab(pair, alternate({"ab": case}, repeats, verbose=False)["ab"])
    rows = alternate({"ours": pair.ours, "theirs": pair.theirs}, repeats, verbose=False)
    return summarise(pair, rows["ours"], rows["theirs"])


def above_keys(path: str) -> set[str]:
    """The keys of the baseline pairs an earlier ``--json`` file measured above 1.00x."""
    try:
        earlier = json.loads(Path(path).read_text())
        return {p["key"] for p in earlier if p["kind"] == "baseline" and p["ratio"] > 1.0}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"above={path}: not a bench_all --json file ({e})") from None


def main(argv: list[str]) -> int:
    out_json = None
    if "--json" in argv:
        i = argv.index("--json")
        out_json, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    ov = parse_overrides(argv)
    suites = ov["suites"].split(",") if "suites" in ov else None
    repeats, timed = int(ov.get("repeats", 5)), int(ov.get("timed_steps", 12))
    pairs = suite_pairs(suites)
    if "only" in ov:
        keep = set(ov["only"].split(","))
        pairs = [p for p in pairs if p.ours.run.scheme in keep or p.theirs.run.scheme in keep]
    if "above" in ov:  # again, the baseline pairs an earlier run measured above 1.00x
        pairs = [p for p in pairs if case_key(p) in above_keys(ov["above"])]
    mode = ov.get("instruments", "true").lower()
    if mode == "only":  # the instrument pairs alone
        pairs = instrument_pairs(pairs)
    elif mode != "false":
        pairs += instrument_pairs(pairs)
    fields = {k: v for k, v in ov.items() if k not in OWN_KEYS}
    started, results = time.time(), []
    for n, pair in enumerate(pairs, 1):
        pair = _with_steps(pair, timed, fields)
        print(f"[{n}/{len(pairs)}] {pair.label}", flush=True)
        try:
            results.append(measure(pair, repeats))
        except Exception as e:  # noqa: BLE001 -- one pair's failure is reported, the rest run
            results.append(failed(pair, e))
        print("  " + results[-1].line(), flush=True)
    print(f"\n{len(results)} pairs, {repeats} alternating repeats each, {timed} timed steps "
          f"(median of those after the warm-up), {time.time() - started:.0f} s\n")
    print(f"{'pair':58s} {'ratio':>7s}  [spread]  repeats  ours / theirs  case")
    for r in results:
        print(r.line())
    print(goals(results))
    if out_json:
        out_json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_terminable(main, sys.argv[1:], prog="bench_all",
                           kept="the pairs printed above are what it measured"))
