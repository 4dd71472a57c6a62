"""``parbench plan model=PRESET world=N device=PROFILE [global_batch_size=] [seq_length=]
[schedules=a,b,...] [accounting=] [attention=eager|flash]``: every parallel layout ranked by
predicted step time (``parbench.plan``), each pruned by ``estimate``'s memory count under the
accounting and attention given; the device line says whether the profile is calibrated or a
preset of datasheet and micro-benchmark figures; the schedules the time model cannot price are named with the reason their
spec gives."""
from __future__ import annotations

import json

from ..config import ConfigError
from ..overrides import coerce, parse_overrides
from .help import own_keys
from .output import UsageError, console

#: the space's knobs a user may narrow on the command line
_SPACE_KEYS = {"max_tp": int, "max_cp": int}


def _shape(ov: dict):
    from ..analytic.shape import shape_from
    from ..config import model_preset
    name = ov.pop("model", None)
    if not name:
        raise UsageError("plan needs model=PRESET (see `parbench list`)")
    extra = {}
    if "seq_length" in ov:
        extra["seq_length"] = coerce(ov.pop("seq_length"), int, "seq_length")
    return shape_from(model_preset(name), **extra), name


def cmd_plan(args: list[str], as_json: bool = False, wide: bool = False) -> int:
    from ..plan import Space, as_dict, plan, unpriced, why
    from ..schedules import SCHEDULES
    from ..timemodel import load_profile
    from ..timemodel.report import device_kind

    ov = parse_overrides(args)
    unknown = sorted(set(ov) - set(own_keys("plan")))
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not a key of plan (keys: "
                          f"{', '.join(own_keys('plan'))}; see parbench plan --help)")
    shape, name = _shape(ov)
    if "world" not in ov:
        raise UsageError("plan needs world=N (the number of devices)")
    world = coerce(ov.pop("world"), int, "world")
    device = ov.pop("device", None)
    if not device:
        raise UsageError("plan needs device=PROFILE (a preset such as a100-80gb, or a "
                         "profile written by `parbench calibrate`)")
    profile = load_profile(device)
    batch = coerce(ov.pop("global_batch_size", str(max(world, 1))), int, "global_batch_size")
    top = coerce(ov.pop("top", "10"), int, "top")
    verbose = coerce(ov.pop("verbose", "false"), bool, "verbose")
    space = Space(**{k: coerce(ov.pop(k), t, k) for k, t in _SPACE_KEYS.items() if k in ov},
                  **_schedules(ov))
    base = _counting(ov)
    res = plan(shape, world, profile, batch, space, keep=top, base=base)
    skipped = unpriced(Space(schedules=tuple(SCHEDULES)))
    if as_json:
        print(json.dumps({"model": name, "world": world, "device": device,
                          "calibrated": profile.calibrated, "device_kind": device_kind(profile),
                          "accounting": _accounting(base), "attention": base.attention,
                          "global_batch_size": batch, "evaluated": res.evaluated,
                          "over_memory": res.over_memory, "bounded": res.bounded,
                          "simulated": res.simulated, "skipped": res.skipped,
                          "seconds": res.seconds,
                          "ranked": [as_dict(trn, st) for trn, st in res.ranked],
                          "unpriced_schedules": skipped}, indent=2, default=str))
        return 0 if res.ranked else 1
    out = console()
    out.print(f"device {profile.name} ({device_kind(profile)}); memory counted as "
              f"`parbench estimate` counts it: {_accounting(base)} model states, "
              f"{base.attention} attention", soft_wrap=True, highlight=False)
    _print(out, name, world, device, batch, res, why)
    for sched, reason in skipped.items():
        out.print(f"  not searched: {sched} -- {reason}", soft_wrap=True)
    if verbose:
        _print_breakdowns(out, res)
    else:
        out.print("  (--verbose: each layout's full breakdown; --json: every figure)")
    return 0 if res.ranked else 1


def _counting(ov: dict):
    """``accounting=`` and ``attention=``: how every candidate's memory is counted, checked
    as ``parbench estimate`` checks them (:class:`parbench.analytic.Counting`)."""
    from ..analytic.counting import Counting
    from ..timemodel import Training
    kw = {k: str(ov.pop(k)) for k in ("accounting", "attention") if k in ov}
    Counting(**kw)  # a bad value fails here, naming the field, the value and the rule
    return Training(**kw)


def _accounting(base) -> str:
    """The accounting's own name (``None``: chosen by the precision, as ``estimate`` does)."""
    from ..analytic.counting import Counting
    return Counting(bytes_per_element=4 if base.dtype == "fp32" else 2,
                    accounting=base.accounting).accounting_name


def _schedules(ov: dict) -> dict:
    """``schedules=1f1b,zbv,...``: the schedules to search (default: the space's)."""
    from ..schedules import SCHEDULES
    if "schedules" not in ov:
        return {}
    names = tuple(n.strip() for n in str(ov.pop("schedules")).split(",") if n.strip())
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise ConfigError(f"schedules={','.join(names)!r}: {', '.join(unknown) or 'none'} "
                          f"not known (choose from {', '.join(SCHEDULES)})")
    return {"schedules": names}


def _print_breakdowns(out, res) -> None:
    """``--verbose``: each ranked layout's step, term by term, in seconds and shares."""
    for i, (trn, st) in enumerate(res.ranked, 1):
        terms = [("compute", st.compute_s), ("recompute", st.recompute_s),
                 ("bubble", st.bubble_s)]
        terms += [(f"exposed {axis}", s) for axis, s in sorted(st.exposed_comm_s.items())]
        parts = ", ".join(f"{k} {v:.3g} s ({100 * v / st.step_s:.1f}%)"
                          for k, v in terms if v) if st.step_s else "no step time"
        out.print(f"  {i:>2}. {_degrees(trn)}: step {st.step_s:.3g} s = {parts}",
                  soft_wrap=True)
        for note in st.notes:
            out.print(f"      {note}", soft_wrap=True)


def _print(out, name, world, device, batch, res, why) -> None:
    from rich.table import Table
    out.print(f"[bold]parbench plan[/] {name} on {world} × {device}, global batch {batch}: "
              f"{res.evaluated} layouts considered in {res.seconds:.2f} s: "
              f"{res.over_memory} over the device's memory; of those that fit, "
              f"{res.bounded} priced with a lower bound ({res.simulated} of them simulated), "
              f"{res.skipped} skipped whole by their group's bound", soft_wrap=True)
    if not res.ranked:
        out.print("[red]no layout fits[/]; the fastest over memory:")
        for trn, st in res.best_over_memory:
            out.print(f"  {_degrees(trn)}: {why(st)}")
        return
    t = Table(show_edge=False)
    for col in ("#", "tp", "cp", "ep", "dp", "pp", "schedule", "zero", "recompute", "b×m",
                "step s", "tokens/s", "MFU", "memory"):
        t.add_column(col, justify="right" if col not in ("schedule", "recompute")
                     else "left")
    for i, (trn, st) in enumerate(res.ranked, 1):
        lay, opt = trn.layout, trn.options
        sched = lay.schedule + (f" v{lay.vpp}" if lay.vpp > 1 else "") if lay.pp > 1 else "—"
        t.add_row(str(i), str(lay.tp), _cp(trn), _ep(trn), str(lay.dp), _pp(trn),
                  sched, str(opt.data.zero_stage), opt.recompute,
                  f"{lay.micro_batch_size}×{lay.num_microbatches}", f"{st.step_s:.3g}",
                  f"{st.tokens_per_s:.3g}", f"{100 * st.mfu:.1f}%",
                  f"{st.memory_per_rank_bytes / 2**30:.1f} GiB")
    out.print(t)
    out.print("why (memory per rank of the device's; bubble, exposed communication of the "
              "heaviest axis and recompute as shares of the step):")
    for i, (_, st) in enumerate(res.ranked, 1):
        out.print(f"  {i:>2}. {why(st)}", soft_wrap=True)


def _cp(trn) -> str:
    """cp, with its attention algorithm where cp > 1 (``4 ulysses``)."""
    cp = trn.layout.cp
    return f"{cp} {trn.options.context.cp_algorithm}" if cp > 1 else str(cp)


def _ep(trn) -> str:
    """ep, with the expert tensor-parallel size where it is not tp (``8 etp1``)."""
    lay = trn.layout
    return f"{lay.ep} etp{lay.etp}" if lay.etp and lay.etp != lay.tp else str(lay.ep)


def _pp(trn) -> str:
    """pp, with uneven end ranks' layers where set (``16 (7,7)``: first, last)."""
    lay = trn.layout
    if not lay.uneven:
        return str(lay.pp)
    return f"{lay.pp} ({lay.first_stage_layers},{lay.last_stage_layers})"


def _degrees(trn) -> str:
    lay, opt = trn.layout, trn.options
    return (f"tp{lay.tp} cp{_cp(trn)} ep{_ep(trn)} dp{lay.dp} pp{_pp(trn)} {lay.schedule} "
            f"zero{opt.data.zero_stage} {opt.recompute} b{lay.micro_batch_size}")
