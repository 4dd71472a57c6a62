"""PTD-P (Narayanan et al. 2021): Table 1's parameter counts and the end-to-end training-time
estimate 8TP/(nX) of Sec. 5.1.

- Parameters: :func:`parbench.analytic.params.textbook_total_params`, the paper's
  P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), for each row's (h, l), V = 51200, s = 2048.
- Training time: :func:`parbench.analytic.flops.training_time_estimate` (8 T P / (n X), full
  recomputation) with P computed from the model's configuration, not the rounded "175
  billion" or "1 trillion".
"""
from __future__ import annotations

from ..analytic.flops import training_time_estimate
from ..analytic.params import textbook_total_params
from ..analytic.shape import Shape
from .core import Cell, Reproduction, Setting, Source, Table

PAPER = ("Narayanan, Shoeybi, Casper, LeGresley, Patwary, Korthikanti, Vainbrand, Kashinkunti, "
         "Bernauer, Catanzaro, Phanishayee, Zaharia 2021, \"Efficient Large-Scale Language "
         "Model Training on GPU Clusters Using Megatron-LM\", SC21, arXiv 2104.04473")

V, S = 51200, 2048

#: Table 1 as printed: parameters (billions), attention heads, hidden size, layers,
#: tensor and pipeline parallel sizes, GPUs, batch size, achieved teraFLOP/s per GPU.
TABLE1 = [
    ("1.7", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]

#: Table 2 as printed (Sec. 5.2, PTD-P against ZeRO-3 without model parallelism): scheme,
#: parameters (billions), tensor and pipeline parallel sizes (1, 1: ZeRO-3 alone), batch
#: size, GPUs, micro-batch size, achieved teraFLOP/s per GPU. Checked against two
#: independent transcriptions (llm-analysis's examples/megatron-lm run scripts, which give
#: (t, p) = (8, 12) and (8, 35), and a Markdown transcription of the table); the 530B
#: ZeRO-3 row on 640 GPUs ran batch 2560 (the table's footnote: it did not fit on 560).
TABLE2 = [
    ("ZeRO-3", "174.6", 1, 1, 1536, 384, 4, 144),
    ("ZeRO-3", "174.6", 1, 1, 1536, 768, 2, 88),
    ("ZeRO-3", "174.6", 1, 1, 1536, 1536, 1, 44),
    ("ZeRO-3", "529.6", 1, 1, 2560, 640, 4, 138),
    ("ZeRO-3", "529.6", 1, 1, 2240, 1120, 2, 98),
    ("ZeRO-3", "529.6", 1, 1, 2240, 2240, 1, 48),
    ("PTD-P", "174.6", 8, 12, 1536, 384, 1, 153),
    ("PTD-P", "174.6", 8, 12, 1536, 768, 1, 149),
    ("PTD-P", "174.6", 8, 12, 1536, 1536, 1, 141),
    ("PTD-P", "529.6", 8, 35, 2240, 560, 1, 171),
    ("PTD-P", "529.6", 8, 35, 2240, 1120, 1, 167),
    ("PTD-P", "529.6", 8, 35, 2240, 2240, 1, 159),
]
#: the two models of Table 2 (heads, hidden, layers): GPT-3's shape (Sec. 5.1) and Table 1's
#: 529.6B row
TABLE2_SHAPES = {"174.6": (96, 12288, 96), "529.6": (128, 20480, 105)}

#: Sec. 5.1 as printed: GPT-3 (h = 12288, l = 96) on T = 300B tokens, n = 1024 GPUs at
#: X = 140 teraFLOP/s; the 1T model (Table 1's last row) on 450B tokens, 3072 GPUs at 163.
ESTIMATES = [
    dict(label="GPT-3 175B", h=12288, l=96, tokens=300e9, gpus=1024, tflops=140, days="34"),
    dict(label="1T (Table 1, last row)", h=25600, l=128, tokens=450e9, gpus=3072, tflops=163,
         days="84"),
]

def gpt_shape(a: int, h: int, l: int) -> Shape:  # noqa: E741
    """The papers' GPT with ``a`` heads, hidden ``h`` and ``l`` layers as a model shape:
    V = 51,200 padded to a multiple of 128 t (Megatron's default), s = 2,048, tied
    embeddings, f = 4h (the planner's Table 1 check and ``reproduce throughput``)."""
    return Shape(vocab_size=V, hidden_size=h, num_layers=l, num_heads=a, seq_length=S,
                 tie_embeddings=True, make_vocab_size_divisible_by=128)


_CHECKED = ("confirmed against two independent transcriptions of Table 1 and a quotation of "
            "Sec. 5.1")


def table1() -> Table:
    cells = []
    for printed, a, h, l, t, p, n, B, x in TABLE1:  # noqa: E741
        tool = textbook_total_params(h, l, V, S) / 1e9
        cells.append(Cell(f"h = {h}, l = {l} (a = {a}, t = {t}, p = {p}, {n} GPUs)",
                          float(printed), tool, "billion", printed=printed))
    cells[0].note = "printed to two significant digits (1.652 billion)"
    return Table(
        key="table1", title="Table 1: number of parameters (billion)",
        source=Source(PAPER, "Table 1 (Sec. 5.1)", _CHECKED),
        config=[Setting("V (vocabulary)", str(V), "Sec. 5.1: all models use 51,200"),
                Setting("s (sequence length)", str(S), "Sec. 5.1"),
                Setting("(h, l) per row", "the hidden size and layer count of each row",
                        "Table 1")],
        method="textbook_total_params(h, l, V, s) = 12lh^2 + 13lh + (V + s)h "
               "(Eq. 2 of the paper, P = 12lh^2 (1 + 13/(12h) + (V + s)/(12lh)))",
        tolerance=0.03, cells=cells,
        notes=["Tolerance 3%: the 1.7B row is printed to two significant digits; every cell "
               "rounds to the printed figure."])


def training_time() -> Table:
    cells = []
    for e in ESTIMATES:
        params = textbook_total_params(e["h"], e["l"], V, S)
        seconds = training_time_estimate(e["tokens"], params, e["gpus"], e["tflops"] * 1e12)
        c = Cell(f"{e['label']}: T = {e['tokens'] / 1e9:g}B tokens, n = {e['gpus']}, "
                 f"X = {e['tflops']} TFLOP/s", float(e["days"]), seconds / 86400, "days",
                 printed=e["days"])
        c.note = f"P = {params / 1e9:.1f} billion from the configuration"
        cells.append(c)
    return Table(
        key="training-time", title="Sec. 5.1: end-to-end training time ~ 8TP/(nX)",
        source=Source(PAPER, "Sec. 5.1, \"Training time estimates\"", _CHECKED),
        config=[Setting("GPT-3", "h = 12288, l = 96, T = 300e9, n = 1024, X = 140e12",
                        "Sec. 5.1 (shape: Brown et al. 2020, Table 2.1)"),
                Setting("1T", "h = 25600, l = 128, T = 450e9, n = 3072, X = 163e12",
                        "Sec. 5.1 and Table 1"),
                Setting("V, s", f"{V}, {S}", "Sec. 5.1")],
        method="training_time_estimate(T, textbook_total_params(h, l, V, s), n, X) / 86400",
        tolerance=0.015, cells=cells,
        notes=["Tolerance 1.5%: the paper prints whole days (34 +- 0.5 is +-1.5%)."])


def reproduce() -> Reproduction:
    return Reproduction(
        name="ptdp", title="PTD-P (Narayanan et al. 2021): Table 1 parameters and 8TP/(nX)",
        tables=[table1(), training_time()],
        intro="Parameter counts of the weak-scaling models and the end-to-end training-time "
              "estimate, from each model's shape.")
