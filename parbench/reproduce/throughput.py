"""The time model against published training runs: each run's step time as published beside
the step :func:`parbench.timemodel.predict_step` predicts for the same model, layout and
batch on the ``a100-80gb-cuda11`` preset (issue 22, sec. 1), the A100 with the GEMM and
element-wise rates its CUDA 11 software reached (the runs' generation); each table also
says what today's ``a100-80gb`` preset predicts.

- PTD-P (Narayanan et al. 2021) Table 1: every row. The paper prints the achieved teraFLOP/s
  per GPU X; the published step is the paper's own FLOP count, Eq. 3,
  96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (activation recomputation counted), over (X n). What
  the table does not print -- each row's micro-batch size, data-parallel implementation and
  interleaving -- comes from the authors' run script for the table
  (:data:`TABLE1_RUNS`).
- PTD-P Table 2 (Sec. 5.2): every row, PTD-P and ZeRO-3 without model parallelism, the
  published step computed as for Table 1 (:func:`table2_rows`).
- Korthikanti et al. 2022 Table 5 (sequence parallelism with selective recomputation): the
  printed iteration times, configurations from their Table 3.

The preset is a datasheet and micro-benchmark profile (``parbench.timemodel.devices``),
never fitted to these rows: the runs of 2021-22 ran CUDA 11's kernels, so their GEMMs and
element-wise kernels are priced at the rates a published micro-benchmark of that software
measured on the same A100 SXM4 80GB (``devices.CUDA11_A100``), not at today's best. A row's tolerance is the issue's goal, 15%; this is a goal table
(:attr:`Table.goal`): its misses are listed as misses, and do not set the command's exit
status, which stays the verdict on the published formulas and figures.
"""
from __future__ import annotations

import statistics

from ..analytic.flops import megatron_eq3_flops
from ..analytic.shape import Shape
from ..timemodel import Training, load_profile, predict_step
from . import korthikanti, ptdp
from .core import Cell, Reproduction, Setting, Source, Table

DEVICE = "a100-80gb-cuda11"
#: today's software on the same GPU, predicted beside it
TODAY = "a100-80gb"
TOLERANCE = 0.15

#: PTD-P Table 1's runs as the authors launched them (NVIDIA/Megatron-LM,
#: examples/academic_paper_scripts/sc21/run_table_1.sh): per row (parameters as printed) the
#: micro-batch size, the data-parallel implementation (``torch``: PyTorch DDP, its bucketed
#: all-reduce overlapping the backward; ``local``: Megatron's, after the backward) and the
#: virtual stages per rank (layers per stage / ``--num-layers-per-virtual-pipeline-stage``;
#: 1: not interleaved); every row with uniform full recomputation and fp16
TABLE1_RUNS = {
    "1.7": (16, "torch", 1), "3.6": (16, "torch", 1), "7.5": (16, "torch", 1),
    "18.4": (8, "torch", 1), "39.1": (4, "local", 1), "76.1": (2, "local", 3),
    "145.6": (2, "local", 2), "310.1": (1, "local", 2), "529.6": (1, "local", 3),
    "1008.0": (1, "local", 1),
}
RUN_SCRIPT = "NVIDIA/Megatron-LM examples/academic_paper_scripts/sc21/run_table_1.sh"


def _predicted(shape: Shape, training: Training, device: str = DEVICE
               ) -> tuple[float, str, float]:
    """The predicted step (s) on ``device``, a note of where its time goes, and its compute
    seconds (forward, backward and recomputation)."""
    st = predict_step(shape, training, load_profile(device))
    comm = ", ".join(f"{k} {v:.2f}" for k, v in st.exposed_comm_s.items() if v > 0)
    return st.step_s, (f"predicted: compute {st.compute_s:.2f} s, recompute "
                       f"{st.recompute_s:.2f} s, bubble {st.bubble_s:.2f} s, exposed "
                       f"communication {comm or 'none'}"), st.compute_s + st.recompute_s


def compute_scale(published: float, step: float, compute: float) -> float:
    """The factor by which a prediction's compute seconds would have to grow (everything
    else kept) for its step to equal the published one: (published - (step - compute)) /
    compute. Nearly one value across a table's rows says its gap grows with the compute,
    not with the communication or the bubble, whose shares differ from row to row."""
    return (published - (step - compute)) / compute


def table1_rows() -> Table:
    """PTD-P Table 1, every row: the published step from the achieved teraFLOP/s."""
    cells, scales, today = [], [], []
    for printed, a, h, l, t, p, n, B, x in ptdp.TABLE1:  # noqa: E741
        d = n // (t * p)
        published = megatron_eq3_flops(B, ptdp.S, l, h, ptdp.V) / (x * 1e12 * n)
        mbs, ddp, vpp = TABLE1_RUNS[printed]
        trn = Training.of(tp=t, pp=p, dp=d, vpp=vpp, micro_batch_size=mbs,
                          num_microbatches=B // (d * mbs),
                          schedule="interleaved" if vpp > 1 else "1f1b", recompute="full",
                          sp=False, zero_stage=0, attention="eager", dtype="fp16",
                          overlap_grad_reduce=ddp == "torch", grad_accumulation="unfused")
        tool, note, compute = _predicted(ptdp.gpt_shape(a, h, l), trn)
        today.append(_predicted(ptdp.gpt_shape(a, h, l), trn, TODAY)[0] / published)
        scales.append(compute_scale(published, tool, compute))
        cells.append(Cell(f"{printed}B: t = {t}, p = {p}, d = {d}, B = {B}, b = {mbs}"
                          + (f", v = {vpp}" if vpp > 1 else "") + f", {x} TFLOP/s",
                          published, tool, "s", note=note))
    return _table(
        "ptdp-table1", "PTD-P Table 1: step time (s), published beside predicted",
        Source(ptdp.PAPER, "Table 1 (achieved teraFLOP/s per GPU), Eq. 3",
               "Table 1 as in parbench.reproduce.ptdp (confirmed there)"),
        [Setting("micro-batch size b per row",
                 ", ".join(str(b) for b, _, _ in TABLE1_RUNS.values()), RUN_SCRIPT),
         Setting("schedule", "interleaved 1F1B with v virtual stages per rank ("
                 + ", ".join(f"{k}B: v = {v}" for k, (_, _, v) in TABLE1_RUNS.items()
                             if v > 1) + "); 1F1B otherwise", RUN_SCRIPT),
         Setting("gradient all-reduce", "PyTorch DDP (overlapping the backward) for the "
                 "rows without pipelining, Megatron's local DDP (after the backward) with it",
                 RUN_SCRIPT + " (--DDP-impl)"),
         Setting("recomputation", "full", "Eq. 3 counts it; --activations-checkpoint-method "
                 "uniform in " + RUN_SCRIPT),
         Setting("attention", "unfused (eager)", "Megatron-LM in 2021 ran no flash kernel"),
         Setting("precision", "fp16 with fp32 master weights and loss scaling",
                 "mixed precision (Sec. 5); fp16 as TABLE1_RUNS records"),
         Setting("gradient accumulation", "unfused: each micro-batch's weight gradient "
                 "added into the gradient buffer by its own pass",
                 "Megatron-LM of the SC21 runs (NGC PyTorch 20.12, examples/sc21/SRUN.sh): "
                 "local DDP's hook adds grad into main_grad; no gradient-accumulation "
                 "fusion yet")],
        "published = megatron_eq3_flops(B, s, l, h, V) / (X n); tool = predict_step(...) "
        f"on {DEVICE}", cells, scales, today)


def _table2_training(scheme: str, t: int, p: int, B: int, n: int, b: int) -> Training:  # noqa: N803
    """A Table 2 run: PTD-P as Table 1's pipelined rows (Megatron's local DDP after the
    backward, 1F1B); ZeRO-3 data-parallel over every GPU, its parameter gathers and gradient
    reduce-scatters exposed (see :func:`table2_rows`); both with full recomputation, fp16,
    eager attention, unfused gradient accumulation."""
    d = n // (t * p)
    return Training.of(tp=t, pp=p, dp=d, micro_batch_size=b, num_microbatches=B // (d * b),
                       schedule="1f1b", recompute="full", sp=False,
                       zero_stage=3 if scheme == "ZeRO-3" else 0, attention="eager",
                       dtype="fp16", overlap_grad_reduce=False, grad_accumulation="unfused")


def table2_rows() -> Table:
    """PTD-P Table 2, every row (PTD-P and ZeRO-3 without model parallelism): the published
    step from the achieved teraFLOP/s, as Table 1.

    ZeRO-3's communication is priced exposed: at a fixed batch its published step falls by
    only 18% from 384 to 768 GPUs and not at all from 768 to 1536 (Sec. 5.2: throughput
    "falls" as cross-node communication grows), which gathers hidden under a compute that
    halves with each doubling cannot produce. Each ZeRO-3 cell's note gives the prediction
    with its communication overlapped beside it."""
    cells, scales, today = [], [], []
    between: list[bool] = []
    for scheme, printed, t, p, B, n, b, x in ptdp.TABLE2:  # noqa: N806
        a, h, l = ptdp.TABLE2_SHAPES[printed]  # noqa: E741
        published = megatron_eq3_flops(B, ptdp.S, l, h, ptdp.V) / (x * 1e12 * n)
        trn = _table2_training(scheme, t, p, B, n, b)
        tool, note, compute = _predicted(ptdp.gpt_shape(a, h, l), trn)
        today.append(_predicted(ptdp.gpt_shape(a, h, l), trn, TODAY)[0] / published)
        if scheme == "ZeRO-3":
            hidden, _, _ = _predicted(ptdp.gpt_shape(a, h, l),
                                      trn.with_values(overlap_grad_reduce=True))
            note += f"; overlapped instead: {hidden:.2f} s"
            between.append(hidden <= published <= tool)
        else:  # the PTD-P rows: Table 1's kind of run
            scales.append(compute_scale(published, tool, compute))
        layout = f"t = {t}, p = {p}" if t * p > 1 else "no model parallelism"
        cells.append(Cell(f"{scheme} {printed}B: {layout}, {n} GPUs, B = {B}, b = {b}, "
                          f"{x} TFLOP/s", published, tool, "s", note=note))
    return _table(
        "ptdp-table2", "PTD-P Table 2: PTD-P and ZeRO-3 step time (s), published beside "
                       "predicted",
        Source(ptdp.PAPER, "Table 2 (achieved teraFLOP/s per GPU), Eq. 3",
               "two independent transcriptions agree (parbench.reproduce.ptdp.TABLE2)"),
        [Setting("PTD-P schedule", "1F1B, not interleaved; Megatron's local DDP after the "
                 "backward", "not printed: an assumption (Table 1's pipelined rows' DDP)"),
         Setting("ZeRO-3", "DeepSpeed stage 3 over all n GPUs, parameter all-gathers "
                 "(forward, backward) and gradient reduce-scatter exposed", "Sec. 5.2; the "
                 "exposure an assumption read from the table's own trend (table2_rows)"),
         Setting("recomputation, precision", "full; fp16 with fp32 masters",
                 "Eq. 3 counts recomputation; Sec. 5 mixed precision"),
         Setting("attention", "unfused (eager)", "Megatron-LM in 2021 ran no flash kernel")],
        "published = megatron_eq3_flops(B, s, l, h, V) / (X n); tool = predict_step(...) "
        f"on {DEVICE}", cells, scales, today, "PTD-P rows",
        [f"ZeRO-3 rows: the published step lies between the overlapped and the exposed "
         f"prediction in {sum(between)} of {len(between)}; how much of its gathers and "
         "reduce-scatters DeepSpeed hid is not published, so the misses are priced exposed, "
         "not fitted"])


def table5_rows() -> Table:
    """Korthikanti et al. Table 5: the printed iteration times."""
    cells, scales, today = [], [], []
    for name, m in korthikanti.MODELS.items():
        d = m["gpus"] // (m["t"] * m["p"])
        trn = Training.of(tp=m["t"], pp=m["p"], dp=d,
                          micro_batch_size=korthikanti.MICRO_BATCH,
                          num_microbatches=m["B"] // (d * korthikanti.MICRO_BATCH),
                          schedule="1f1b", recompute="selective", sp=True, zero_stage=0,
                          attention="eager")
        shape = ptdp.gpt_shape(m["a"], m["h"], m["l"])
        tool, note, compute = _predicted(shape, trn)
        today.append(_predicted(shape, trn, TODAY)[0] / float(m["time"]))
        scales.append(compute_scale(float(m["time"]), tool, compute))
        cells.append(Cell(f"{name}: t = {m['t']}, p = {m['p']}, {m['gpus']} GPUs, "
                          f"B = {m['B']}", float(m["time"]), tool, "s", printed=m["time"],
                          note=note))
    return _table(
        "korthikanti-table5", "Korthikanti et al. Table 5: iteration time (s), published "
                              "beside predicted",
        Source(korthikanti.PAPER, "Table 5 (iteration times), Table 3 (configurations)",
               "as in parbench.reproduce.korthikanti"),
        [Setting("micro-batch size", str(korthikanti.MICRO_BATCH), "Table 3"),
         Setting("schedule", "1F1B, not interleaved", "not printed: an assumption"),
         Setting("recomputation", "selective, sequence parallel", "Table 5 (present work)"),
         Setting("attention", "unfused (eager)", "the paper's attention core (Sec. 4)"),
         Setting("gradient accumulation", "fused into the weight-gradient GEMM",
                 "an assumption: Megatron-LM's gradient_accumulation_fusion, which its 2022 "
                 "code ran")],
        f"tool = predict_step(...) on {DEVICE}", cells, scales, today)


def _table(key: str, title: str, source: Source, config: list[Setting], method: str,
           cells: list[Cell], scales: list[float], today: list[float], which: str = "rows",
           extra: list[str] | None = None) -> Table:
    """A goal table of ``cells`` on :data:`DEVICE`; its notes give the ratios' spread, where
    the gap lies (``scales``) and the ratios on today's preset (``today``)."""
    ratios = [c.tool / c.published for c in cells]
    errors = [c.rel_error for c in cells]
    where = (f"where the gap lies ({which}, compute_scale): the predicted compute would have "
             f"to be x {statistics.median(scales):.3f} (range {min(scales):.3f} to "
             f"{max(scales):.3f}), everything else kept, for each step to equal the "
             "published one")
    return Table(
        key=key, title=title, source=source,
        config=config + [Setting("device", f"{DEVICE}: the A100 SXM4 80GB's datasheet, its "
                                 "GEMMs and element-wise kernels at the rates CUDA 11 "
                                 "software reached (the runs' generation)",
                                 "parbench.timemodel.devices (CUDA11_A100: Mu Li's "
                                 "transformers-benchmarks, 2022), not fitted")],
        method=method, tolerance=TOLERANCE, cells=cells, goal=True,
        notes=[f"predicted / published: median {statistics.median(ratios):.3f}, range "
               f"{min(ratios):.3f} to {max(ratios):.3f}; median |error| "
               f"{100 * statistics.median(errors):.1f}% (issue 22's goal: every row within "
               "15%, median within 7%)", where,
               f"on today's {TODAY} preset instead (its GEMMs at the best rate a 2025 search "
               f"found, its memory at a read kernel's bandwidth): predicted / published "
               f"median {statistics.median(today):.3f}, range {min(today):.3f} to "
               f"{max(today):.3f}; {sum(abs(r - 1) <= TOLERANCE for r in today)} of "
               f"{len(today)} within 15%"] + (extra or []))


def reproduce() -> Reproduction:
    tables = [table1_rows(), table2_rows(), table5_rows()]
    errors = [c.rel_error for t in tables for c in t.cells]
    return Reproduction(
        name="throughput",
        title="The time model against published training runs (PTD-P Tables 1 and 2, "
              "Korthikanti et al. Table 5)",
        tables=tables,
        intro="Each published run's step time beside the time model's prediction for the "
              f"same model, layout and batch on the {DEVICE} preset. A goal table: its "
              "misses are reported, not excused. Median |error| over all "
              f"{len(errors)} cells: {100 * statistics.median(errors):.1f}% (issue 22's "
              "goal: within 7%).")
