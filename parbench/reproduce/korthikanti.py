"""Korthikanti et al. 2022: Table 2 (activation memory per layer), the selective-recomputation
savings stated in the text, and the MFU column of Table 5 from its iteration times.

- Table 2 prints formulas. The published cell is the printed formula evaluated for each of the
  paper's models (Table 3 shapes, s = 2048, micro-batch 1, t = 8); the tool's figure is
  :func:`parbench.analytic.activations.layer_activation_bytes`, which derives the count
  tensor by tensor (bytes per element, masks, f = 4h) rather than from the printed formula.
- Table 5's MFU: model FLOPs per iteration over (iteration time x GPUs x 312 TFLOP/s, the
  A100's bf16 peak). The model FLOPs are the paper's 72 B s l h^2 (1 + s/(6h) + V/(12 h l))
  (Sec. 6, Appendix), which is :func:`parbench.analytic.flops.training_flops` without
  recomputation term by term (3 x (24Bsh^2 + 4Bs^2h) per layer + 3 x 2BshV); the ratio is
  :func:`parbench.analytic.flops.mfu`.
"""
from __future__ import annotations

from ..analytic.activations import layer_activation_bytes
from ..analytic.flops import mfu, training_flops
from .core import Cell, Reproduction, Setting, Source, Table

PAPER = ("Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro 2022, \"Reducing "
         "Activation Recomputation in Large Transformer Models\", MLSys 2023, arXiv 2205.05198")

S, V, MICRO_BATCH = 2048, 51200, 1
A100_PEAK = 312e12   # bf16 dense, FLOP/s per GPU

#: Table 3 (model configurations) and Table 5 (present work: sequence parallelism with
#: selective recomputation): heads a, hidden h, layers l, tensor t and pipeline p parallel
#: sizes, GPUs, global batch B, iteration time (s) and MFU (%) as printed.
MODELS = {
    "22B": dict(a=64, h=6144, l=48, t=8, p=1, gpus=8, B=4, time="1.10", mfu="41.5"),
    "175B": dict(a=96, h=12288, l=96, t=8, p=8, gpus=64, B=64, time="13.75", mfu="51.4"),
    "530B": dict(a=128, h=20480, l=105, t=8, p=35, gpus=280, B=280, time="37.83", mfu="56.0"),
    "1T": dict(a=160, h=25600, l=128, t=8, p=64, gpus=512, B=512, time="71.49", mfu="56.3"),
}

#: Table 2 as printed: activation bytes per layer = s b h (c + ct/t + ca a s/h + cat a s/(h t)),
#: with the tool's arguments for the same setting.
TABLE2 = [
    ("no parallelism", "sbh(34 + 5as/h)", (34, 0, 5, 0),
     dict(t=1, sp=False, recompute="none")),
    ("tensor parallel (baseline)", "sbh(10 + 24/t + 5as/(ht))", (10, 24, 0, 5),
     dict(sp=False, recompute="none")),
    ("tensor + sequence parallel", "sbh(34/t + 5as/(ht))", (0, 34, 0, 5),
     dict(sp=True, recompute="none")),
    ("tensor parallel + selective recompute", "sbh(10 + 24/t)", (10, 24, 0, 0),
     dict(sp=False, recompute="selective")),
    ("tensor + sequence parallel + selective recompute", "sbh(34/t)", (0, 34, 0, 0),
     dict(sp=True, recompute="selective")),
    ("full activation recompute", "2sbh", (2, 0, 0, 0),
     dict(sp=False, recompute="full")),
]

#: The text on selective recomputation: 5as/h for GPT-3 and the share of activation
#: memory it saves for GPT-3 (175B) and MT-NLG (530B), as printed.
SELECTIVE = [("GPT-3: 5as/h", "175B", "ratio", "80"),
        ("GPT-3: activation memory saved by selective recomputation", "175B", "saving", "70"),
        ("MT-NLG: activation memory saved by selective recomputation", "530B", "saving", "65")]

_SRC_T3 = ("Table 3 (175B is GPT-3's shape, Brown et al. 2020; 530B and 1T are PTD-P Table "
           "1's; the 22B shape is unconfirmed)")
_CHECKED_T5 = ("partly confirmed: Megatron-LM's README quotes the same MFU for these four model "
               "sizes (41.5%, 51.4%, 56.0%, 56.3%); the iteration times, GPU counts and batch "
               "sizes, the inputs, are unconfirmed: no text copy of Tables 3 and 5 could be "
               "consulted here")


def _published_table2(coeffs, s, b, h, a, t) -> float:
    c, ct, ca, cat = coeffs
    return s * b * h * (c + ct / t + ca * a * s / h + cat * a * s / (h * t))


def table2() -> Table:
    cells = []
    for model, m in MODELS.items():
        for row, formula, coeffs, kw in TABLE2:
            t = kw.get("t", m["t"])
            pub = _published_table2(coeffs, S, MICRO_BATCH, m["h"], m["a"], t)
            tool = layer_activation_bytes(S, MICRO_BATCH, m["h"], m["a"], t=t, sp=kw["sp"],
                                          recompute=kw["recompute"])
            cells.append(Cell(f"{model}, {row}: {formula}", pub / 1e6, tool / 1e6, "MB"))
    return Table(
        key="table2", title="Table 2: activation memory per transformer layer (bytes)",
        source=Source(PAPER, "Table 2",
                      "confirmed: the five formulas and 2sbh are quoted by several "
                      "secondary sources"),
        config=[Setting("models (a, h)", ", ".join(f"{k}: ({m['a']}, {m['h']})"
                                                  for k, m in MODELS.items()), _SRC_T3),
                Setting("s, micro-batch b", f"{S}, {MICRO_BATCH}", "Table 3"),
                Setting("t", "8 (1 for the no-parallelism row)", "Table 3"),
                Setting("bytes", "2 per activation, 1 per dropout-mask element, f = 4h",
                        "the paper's per-layer count")],
        method="layer_activation_bytes(s, b, h, a, t, sp, recompute) with the paper's "
               "defaults (2-byte activations, 1-byte masks, dropout, eager attention); "
               "MB = 10^6 B",
        tolerance=1e-9, cells=cells,
        notes=["The published cell is the printed formula evaluated; the tool derives the "
               "same count from the saved tensors (attention 11sbh + 5as^2b, MLP 19sbh, "
               "LayerNorms 4sbh), so they agree exactly."])


def selective() -> Table:
    cells = []
    for label, model, kind, printed in SELECTIVE:
        m = MODELS[model]
        if kind == "ratio":   # the s x s term over sbh: (no recompute - selective) / sbh
            full = layer_activation_bytes(S, MICRO_BATCH, m["h"], m["a"], t=1)
            sel = layer_activation_bytes(S, MICRO_BATCH, m["h"], m["a"], t=1,
                                         recompute="selective")
            tool, unit = (full - sel) / (S * MICRO_BATCH * m["h"]), ""
        else:                 # with TP + SP: the share does not depend on t
            full = layer_activation_bytes(S, MICRO_BATCH, m["h"], m["a"], t=m["t"], sp=True)
            sel = layer_activation_bytes(S, MICRO_BATCH, m["h"], m["a"], t=m["t"], sp=True,
                                         recompute="selective")
            tool, unit = 100 * (1 - sel / full), "%"
        cells.append(Cell(label, float(printed), tool, unit, printed=printed))
    return Table(
        key="selective", title="Selective activation recomputation: what it saves (text)",
        source=Source(PAPER, "the section on selective activation recomputation",
                      "confirmed against a secondary summary quoting 5as/h = 80 and 70% for "
                      "GPT-3, 65% for MT-NLG"),
        config=[Setting("GPT-3 (a, h)", "(96, 12288)", "Table 3; Brown et al. 2020"),
                Setting("MT-NLG (a, h)", "(128, 20480)", "Table 3; PTD-P Table 1"),
                Setting("s, b, t", f"{S}, {MICRO_BATCH}, 8, sequence parallel", "Table 3")],
        method="5as/h = (layer_activation_bytes(none) - layer_activation_bytes(selective)) "
               "/ sbh; saving = 1 - selective / none, both with tensor + sequence parallelism",
        tolerance=0.01, cells=cells,
        notes=["Tolerance 1%: the savings are printed as whole percentages (70.2% and "
               "65.3% exactly)."])


def table5() -> Table:
    cells = []
    for model, m in MODELS.items():
        flops = training_flops(m["B"], S, m["h"], m["l"], V, recompute=False)
        tool = 100 * mfu(flops, float(m["time"]), A100_PEAK, m["gpus"])
        c = Cell(f"{model}: {m['time']} s on {m['gpus']} GPUs, B = {m['B']}",
                 float(m["mfu"]), tool, "%", printed=m["mfu"])
        c.note = (f"the iteration time is printed to 10 ms: +-{0.005 / float(m['time']):.2%} "
                  "of MFU")
        cells.append(c)
    return Table(
        key="table5", title="Table 5: model FLOPs utilization from the iteration times "
                            "(sequence parallelism + selective recomputation)",
        source=Source(PAPER, "Table 5, configurations from Table 3", _CHECKED_T5),
        config=[Setting(f"{k}", f"a={m['a']}, h={m['h']}, l={m['l']}, t={m['t']}, "
                        f"p={m['p']}, GPUs={m['gpus']}, B={m['B']}, time={m['time']} s",
                        "Tables 3 and 5 (unconfirmed)") for k, m in MODELS.items()]
        + [Setting("s, V", f"{S}, {V}", "Sec. 6"),
           Setting("peak", "312 TFLOP/s per A100 (bf16)", "NVIDIA A100 datasheet; Sec. 6")],
        method="100 x mfu(training_flops(B, s, h, l, V, recompute=False), time, 312e12, GPUs)"
               " -- 72 B s l h^2 (1 + s/(6h) + V/(12hl)) model FLOPs per iteration",
        tolerance=0.005, cells=cells,
        notes=["Tolerance 0.5%: the 22B model's 1.10 s, printed to 10 ms, leaves MFU "
               "uncertain by +-0.45% on its own.",
               "The HFU column and the full-recompute rows are not reproduced: the tool has "
               "no closed form for the hardware FLOPs of selective recomputation, and the "
               "full-recompute iteration times could not be confirmed."])


def reproduce() -> Reproduction:
    return Reproduction(
        name="korthikanti",
        title="Korthikanti et al. 2022: Table 2 (activation memory), selective "
              "recomputation, Table 5 (MFU)",
        tables=[table2(), selective(), table5()],
        intro="Activation memory per layer under tensor / sequence parallelism and "
              "recomputation, and model FLOPs utilization from the published iteration "
              "times.")
