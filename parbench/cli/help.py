"""``parbench VERB --help``: each verb's usage, keys and an example, from one table.

``VERBS_HELP`` holds every verb's own keys (what the verb pops from its ``key=value``
arguments before anything else); verbs that take a case's fields (``run``, ``verify``,
``selftest``) list them from :func:`parbench.overrides.field_table`, the table that resolves
and validates them. ``own_keys(verb)`` is what a verb's unknown-key error lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..overrides import SECTIONS, field_table


@dataclass(frozen=True)
class VerbHelp:
    """One verb: its usage line, what it does, its own keys (name -> help), whether it
    takes a case's fields, and an example."""

    usage: str
    summary: str
    keys: dict[str, str] = field(default_factory=dict)
    #: the sections of a case's fields the verb takes (``SECTIONS``: all of them)
    case_fields: tuple[str, ...] = ()
    example: str = ""


_CASE = "bare (pp=4), dotted (layout.pp=4) or an alias (zero=1)"

VERBS_HELP: dict[str, VerbHelp] = {
    "run": VerbHelp(
        "run suite=NAME|scheme=NAME [key=value ...] [--json] [--wide]",
        "run a suite (or one case) on local ranks, or join a torchrun / Slurm job as a rank",
        {"suite": "a suite name (parbench list) or a .yaml file", "scheme": "run one case",
         "out": "results directory (default results/<suite>-<time>)",
         "resume": "true: skip the cases already in out=", "world_size": "ranks (torchrun)",
         "deepspeed_config": "a DeepSpeed JSON whose batch, ZeRO and optimizer apply"},
        SECTIONS, "parbench run suite=pipeline pp=2"),
    "verify": VerbHelp(
        "verify scheme=pkg.module:Class|file.py:Class [suite=NAME] [key=value ...]",
        "your own scheme against the golden run, its family's native scheme and the closed "
        "forms (exit 0 equivalent, 3 not, 2 bad input)",
        {"scheme": "pkg.module:Class or path/file.py:Class",
         "suite": "cases to run it on (no suite, no field: the family's default case set)",
         "strict_bytes": "true: bytes that differ from the native scheme fail too"},
        SECTIONS, "parbench verify scheme=examples/my_ddp/my_ddp/ddp.py:MyDDP"),
    "compare": VerbHelp(
        "compare OLD NEW [key=value ...]",
        "two results directories matched case by case, or two scripts/bench_all.py --json "
        "files pair by pair; exit 1 on a regression (a CI gate)",
        {"bytes_tol": "relative increase of bytes and calls tolerated (0)",
         "time_tol": "auto (from the repeated steps' noise) or a fixed ratio",
         "ignore_time": "true: time never gates", "match": "id | config",
         "gate_baselines": "true: a baseline's figures gate too"},
        example="parbench compare results/old results/new time_tol=0.2"),
    "list": VerbHelp("list", "suites, schemes, schedules and model presets",
                     example="parbench list"),
    "report": VerbHelp("report DIR [--wide]", "re-render tables and figures of a results "
                       "directory", example="parbench report results/smoke-20261127"),
    "schedule": VerbHelp(
        "schedule NAME p=4 m=8 [v=2] [tf=1 tb=1 tw=1 p2p=0]",
        "a pipeline schedule simulated: makespan, bubble, in-flight activations per rank, "
        "and the per-rank grid (drawn for small schedules)",
        {"p": "pipeline ranks", "m": "micro-batches", "v": "chunks per rank",
         "tf": "forward cost", "tb": "backward-for-inputs cost", "tw": "weight cost",
         "p2p": "cost of one transfer"},
        example="parbench schedule zbv p=4 m=8"),
    "estimate": VerbHelp(
        "estimate [model=PRESET] [key=value ...] | params=7.5e9 dp=64",
        "the analytic model of any configuration at any scale: parameters, FLOPs, memory "
        "per rank, communication per axis; with device=, the time model's step",
        {"model": "a preset (parbench list)", "params": "a bare parameter count",
         "megatron_args": "Megatron-LM arguments to import", "global_batch_size": "sequences",
         "accounting": "bytes per parameter of the model states", "attention": "eager|flash",
         "causal_flops": "full|half", "logits_dtype": "fp32|bf16", "generate": "KV cache of "
         "N generated tokens", "dtype": "fp32|bf16|fp16",
         "bytes_per_element": "bytes of an element (instead of dtype)",
         "device": "a device profile",
         "device_gb": "device memory (ZeRO's largest model that fits)",
         "schedule": "the time model's pipeline schedule", "verbose": "the full breakdown"},
        tuple(s for s in SECTIONS if s != "run"),
        "parbench estimate model=gpt3-175b tp=8 pp=16 dp=8 device=a100-80gb"),
    "traffic": VerbHelp("traffic [preset=ubmesh-moe-2t] [key=value ...]",
                        "the per-parallelism traffic table", {"preset": "a traffic preset"},
                        example="parbench traffic"),
    "calibrate": VerbHelp(
        "calibrate [device=cpu|cuda] [key=value ...]",
        "measure this machine (matmul, memory bandwidth, each collective per group size) "
        "into a device profile", {"device": "cpu | cuda",
                                  "world_size": "ranks (1: compute only)",
                                  "links_from": "a preset whose links a 1-rank profile takes",
                                  "model": "models whose layers are timed",
                                  "quick": "true: fewer sizes", "out": "the profile file"},
        example="parbench calibrate quick=true"),
    "plan": VerbHelp(
        "plan model=PRESET world=N device=PROFILE [key=value ...]",
        "every parallel layout the rules accept, priced by the time model, pruned by memory",
        {"model": "a preset", "world": "devices", "device": "a device profile",
         "global_batch_size": "sequences per step (default: world)",
         "seq_length": "override the preset's", "top": "layouts shown (10)",
         "verbose": "each layout's breakdown", "max_tp": "largest tp (8)",
         "max_cp": "largest cp (8)", "schedules": "comma-separated schedules to search",
         "accounting": "bytes per parameter of the model states (as estimate)",
         "attention": "eager|flash (activation memory and the attention core's time, as estimate)"},
        example="parbench plan model=gpt3-175b world=96 device=a100-80gb"),
    "reproduce": VerbHelp("reproduce NAME|all [out=DIR]",
                          "a paper's table beside the tool's figures",
                          {"out": "directory (out=- prints the markdown)"},
                          example="parbench reproduce ptdp"),
    "mesh": VerbHelp("mesh tp=2 pp=2 dp=2 [cp= ep= etp=]",
                     "the rank grid and every process group, as Megatron-Core builds them",
                     {"tp": "tensor-parallel degree", "cp": "context-parallel degree",
                      "ep": "expert-parallel degree", "etp": "expert tensor-parallel degree",
                      "dp": "data-parallel degree", "pp": "pipeline degree"},
                     example="parbench mesh tp=2 pp=2 dp=2"),
    "golden": VerbHelp(
        "golden record|check [dir=golden] [suite=a,b] [keys=main|all]",
        "record: write the golden runs of the suites' keys (the directory then holds exactly "
        "those); check: recompute each stored run and hold it to the verdict's noise rule "
        "(exit 1 when a file fails)",
        {"dir": "golden directory (default: the repository's golden/)",
         "suite": "record: the suites whose keys to record (default: all)",
         "keys": "record: main (each suite's most shared key, the default) | all"},
        example="parbench golden check"),
    "selftest": VerbHelp("selftest [profile=ci|full] [seeds=5] [only=ID,...] [--json]",
                         "inject the catalogue of bugs: every one must be caught by a check "
                         "(exit 3: one survived or a correct scheme failed; 1: one only "
                         "crashed or was refused before running)",
                         {"profile": "ci (a sample: every scheme's mutants at least once) "
                                     "| full", "seeds": "seeds per mutant",
                          "only": "mutant ids"}, SECTIONS, "parbench selftest only=ddp-no-divide"),
}


def own_keys(verb: str) -> list[str]:
    """The keys a verb reads besides a case's fields."""
    return list(VERBS_HELP[verb].keys)


def verb_help(verb: str) -> str:
    """The text of ``parbench VERB --help``."""
    h = VERBS_HELP[verb]
    lines = [f"usage: parbench {h.usage}", "", h.summary]
    if h.keys:
        lines += ["", "keys:"]
        lines += [f"  {k + '=':<20} {v}".rstrip() for k, v in h.keys.items()]
    if h.case_fields:
        lines += ["", f"case fields ({_CASE}):"] + case_field_lines(h.case_fields)
    if h.example:
        lines += ["", f"example: {h.example}"]
    return "\n".join(lines)


def case_field_lines(sections: tuple[str, ...] = SECTIONS) -> list[str]:
    """The case fields of ``sections``, by section: name, type, default, rule and help."""
    table = field_table()
    out = []
    for sec in sections:
        rows = [f for f in table.values() if f.section == sec]
        if not rows:
            continue
        out.append(f"  [{sec}]")
        for f in rows:
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            rule = f" ({f.rule})" if f.rule else ""
            text = f"{f.help}{rule}".strip()
            out.append(f"    {f.name + '=':<26} {kind:<6} {str(f.default):<10} {text}".rstrip())
    return out


def usage() -> str:
    """``parbench --help``: one line per verb."""
    lines = ["usage: parbench VERB [key=value ...] [--json] [--wide] [--verbose]", "",
             "verbs (parbench VERB --help for each one's keys and an example):"]
    lines += [f"  {v:<10} {h.summary}" for v, h in VERBS_HELP.items()]
    lines += ["", "flags: --json (machine-readable output), --wide (every column of the result "
              "tables), --verbose (estimate and plan: the full breakdown)"]
    return "\n".join(lines)
