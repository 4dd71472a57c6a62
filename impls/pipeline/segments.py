"""Seq1F1B and TeraPipe on real ranks: the executor of token-slice units and the schemes.

The schedules (``parbench.schedules.segments``) number (micro-batch, slice) units
``u = mb * k + j``; this executor runs them with the pipeline executor's transfers and
dispatch loop, and its own forward and backward of a unit (``segment_forward``):

* F of unit (mb, j): the stage forward of slice j (tokens ``offset_j .. offset_j + l_j - 1``)
  reading the K/V that slices 0..j-1 of the same micro-batch left on this stage; the slice's
  own K/V per layer are kept for the later slices (``kv``);
* BW of unit (mb, j): one backward of the slice's graph from its output (output gradient
  received, or the weighted loss) and from its K/V (the gradients the later slices' backwards
  gave them, ``kv_grad``), to the parameters, the received input and the cache leaves the
  slice read -- whose gradients go to the earlier slices' ``kv_grad``. The schedules run
  slice k-1's backward first, so every slice's K/V gradient is complete when its backward
  runs.

Messages carry ``b l_j h`` elements (``recv_shape``). The loss of a slice is weighted by
``l_j / s`` and then divided by m like every micro-batch loss, so the accumulated gradients
are the full-batch token mean's -- the golden run's.
"""
from __future__ import annotations

from functools import partial

import torch

from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.schedules import ScheduleError, make_schedule, simulate, validate
from parbench.schedules.segments import segment_p2p, seq1f1b_inflight, seq1f1b_memory_ratio
from parbench.schedules.slicing import SliceCost, slices_for, slicing_figures, unit_cost
from parbench.scheme import Prediction

from .executor import Executor, StepOutcome
from .prediction import add_clip_traffic, add_tied_traffic, pipeline_prediction
from .scheme import PipelineScheme
from .segment_forward import SliceForward


class SegmentExecutor(Executor):
    """The pipeline executor over token-slice units (``slices``: the k slice lengths)."""

    #: how a stage runs one slice (the self-test's mutants swap in broken ones)
    slice_forward_class = SliceForward

    def __init__(self, *, slices: list[int], **kw):
        self.slices = list(slices)
        self.k = len(self.slices)
        self.offsets = [sum(self.slices[:j]) for j in range(self.k)]
        self.seq_length = sum(self.slices)
        self.slice_forward = self.slice_forward_class()
        super().__init__(**kw)

    def _reset(self) -> None:
        super()._reset()
        # per (mb, stage, pipe): slice j -> its K/V per layer, and the K/V gradients so far
        self.kv: dict[tuple, dict[int, list]] = {}
        self.kv_grad: dict[tuple, dict[int, list]] = {}

    def recv_shape(self, key) -> tuple:
        b, _, h = self.act_shape
        return (b, self.slices[key[1] % self.k], h)

    def _unit(self, a) -> tuple[tuple, int]:
        mb, j = divmod(a.mb, self.k)
        return (mb, a.stage, a.pipe), j

    def _forward(self, slot, a, received, x, y):
        cell, j = self._unit(a)
        module = slot.module
        inp = x if module.first else received.requires_grad_(True)
        earlier = self.kv.setdefault(cell, {})
        cached = [[earlier[i][layer] for i in range(j)] for layer in range(len(module.blocks))]
        params = slot.params
        run = self.slice_forward
        kwargs = {"offset": self.offsets[j], "seq_length": self.seq_length, "cached": cached}
        if self.track:
            with self.activations.forward([*params, x, y]):
                res = run(module, inp, y, **kwargs)
        else:
            res = run(module, inp, y, **kwargs)
        out = res.out
        if module.last:
            self._loss_sum += float(out.detach())
            out = out / self.weights.loss_divisor(self.m)
        earlier[j] = res.own
        self.saved[(a.mb, a.stage, a.pipe)] = {
            "boundary": None if module.first else inp, "out": out, "params": params,
            "leaves": res.leaves}
        return None if module.last else out.detach()

    def _backward_full(self, slot, a, received):
        cell, j = self._unit(a)
        saved = self.saved.pop((a.mb, a.stage, a.pipe))
        own = self.kv[cell].pop(j)
        kv_grads = self.kv_grad.get(cell, {}).pop(j, None)
        outputs, grad_outputs = [saved["out"]], [received]
        if kv_grads is not None:
            for (k, v), (dk, dv) in zip(own, kv_grads):
                for t, g in ((k, dk), (v, dv)):
                    if g is not None:
                        outputs.append(t)
                        grad_outputs.append(g)
        params, boundary = saved["params"], saved["boundary"]
        leaves = [(i, layer, w, t) for layer, pairs in enumerate(saved["leaves"])
                  for i, pair in enumerate(pairs) for w, t in enumerate(pair) if t.requires_grad]
        inputs = list(params) + ([boundary] if boundary is not None else []) + \
            [t for *_, t in leaves]
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
        self.weights.on_grads(slot, a.mb, params, list(grads[:len(params)]))
        dx = grads[len(params)] if boundary is not None else None
        into = self.kv_grad.setdefault(cell, {})
        for (i, layer, w, _), g in zip(leaves, grads[len(inputs) - len(leaves):]):
            if g is None:
                continue
            slot_grads = into.setdefault(i, [[None, None] for _ in own])[layer]
            slot_grads[w] = g if slot_grads[w] is None else slot_grads[w] + g
        for store in (self.kv, self.kv_grad):
            if not store.get(cell, True):
                del store[cell]
        return dx

    def run(self, xs, ys, step: int = 0, track: bool = True) -> StepOutcome:
        """``xs``/``ys``: the step's m micro-batches; each is cut into its k slices."""
        bounds = list(zip(self.offsets, self.slices))
        unit_x = [x[:, o:o + n] for x in xs for o, n in bounds]
        unit_y = [y[:, o:o + n] for y in ys for o, n in bounds]
        outcome = super().run(unit_x, unit_y, step, track)
        if self.kv or self.kv_grad:
            raise RuntimeError(f"token-slice executor: rank {self.pp_rank} ended the step with "
                               f"K/V left for {sorted(self.kv)[:4]} {sorted(self.kv_grad)[:4]}")
        return outcome


class SegmentScheme(PipelineScheme):
    """A token-slice pipeline: ``seq_segments`` slices per micro-batch."""

    options = ("vpp", "seq_segments")
    #: a slice attends to the cached keys of earlier slices with a causal offset only
    supports_loss_mask = False  # not yet: per-micro-batch token scaling only in sync
    supports_packing = False
    #: a slice's attention over the cached keys reads the MHA heads (no MLA latent cache)
    model_features = MODEL_FEATURES
    executor_class = SegmentExecutor

    @classmethod
    def token_slices(cls, case: CaseConfig) -> list[int]:
        """The k slice lengths of every micro-batch (uniform; TeraPipe may use its DP)."""
        par = case.layout
        return slices_for(case.model.seq_length, case.options.pipeline.seq_segments, "uniform",
                          hidden=case.model.hidden_size, stages=par.pp,
                          m=par.num_microbatches)

    @classmethod
    def case_schedule(cls, case: CaseConfig):
        par = case.layout
        if not 1 <= case.options.pipeline.seq_segments <= case.model.seq_length:
            raise ConfigError(f"seq_segments={case.options.pipeline.seq_segments} must be in "
                              f"[1, seq_length="
                              f"{case.model.seq_length}] (token slices per sequence)")
        try:
            if par.vpp != 1:
                raise ScheduleError(f"vpp={par.vpp}: {cls.schedule_name} holds one stage per "
                                    "rank per replica (set vpp=1)")
            return validate(make_schedule(cls.schedule_name, par.pp, par.num_microbatches,
                                          segments=case.options.pipeline.seq_segments))
        except ScheduleError as e:
            raise ConfigError(f"pp={par.pp}, num_microbatches={par.num_microbatches}, "
                              f"seq_segments={case.options.pipeline.seq_segments}: {e}") from None

    @classmethod
    def step_schedule(cls, case: CaseConfig):
        return cls.case_schedule(case)

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        try:
            cls.token_slices(case)
        except ValueError as e:
            raise ConfigError(f"seq_segments={case.options.pipeline.seq_segments}, seq_length="
                              f"{case.model.seq_length}: {e}") from None

    def make_executor(self):
        """The pipeline scheme's executor, given this case's slice lengths."""
        self.executor_class = partial(type(self).executor_class,
                                      slices=self.token_slices(self.ctx.case))
        return super().make_executor()

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        """Per-rank p2p bytes and calls (``segment_p2p``); model states as 1F1B's (the
        linear placement's closed form, ``prediction.pipeline_prediction``)."""
        par, cfg = case.layout, case.model
        p, m, k = par.pp, par.num_microbatches, case.options.pipeline.seq_segments
        pred = pipeline_prediction(case, cls.schedule_name)
        wire, calls = [], []
        for r in range(p):
            nbytes, ncalls = segment_p2p(p, m, k, r, b=par.micro_batch_size,
                                         s=cfg.seq_length, h=cfg.hidden_size)
            wire.append({"pp": float(nbytes)} if nbytes else {})
            calls.append({"pp": ncalls} if ncalls else {})
        add_tied_traffic(case, cls.schedule_name, wire, calls)
        add_clip_traffic(case, wire, calls)
        figures = dict(pred.figures, token_slices=cls.token_slices(case), segments=k)
        return Prediction(wire_bytes=wire, model_state_bytes=pred.model_state_bytes,
                          calls=calls, figures=figures)

    def metrics(self):
        out = super().metrics()
        p, m, k = self.schedule.p, self.m, self.schedule.segments
        out["token_slices"] = self.token_slices(self.ctx.case)
        out["bubble"].detail.update(self.segment_figures(p, m, k))
        return out

    def segment_figures(self, p: int, m: int, k: int) -> dict:
        return {}


#: what the Seq1F1B paper claims about memory, beside the figures this tool measures
SEQ1F1B_MEMORY_NOTE = (
    "Sun et al. 2024 (abstract, Sec. 4) report half the memory footprint of Megatron's 1F1B "
    "(and 1.14x its throughput) on long sequences. Per stage the schedule implies "
    "(p-r+k-1)/(k (p-r)) of 1F1B's activations (p-r+k-1 units of 1/k micro-batch in flight, "
    "the warm-up p-r+k-2 of the authors' code): 1/2 + 1/(2p) on stage 0 at k = 2, -> 1/k for "
    "p >> k. Compare activation_peak_bytes with a pipeline.1f1b run of the same case.")


class Seq1F1BScheme(SegmentScheme):
    """Seq1F1B (Sun et al. 2024): 1F1B over (micro-batch, slice) units."""

    def segment_figures(self, p, m, k):
        return {"inflight_units_closed_form": [seq1f1b_inflight(p, m, k, r) for r in range(p)],
                "activation_ratio_vs_1f1b_closed_form": [
                    seq1f1b_memory_ratio(p, m, k, r) for r in range(p)],
                "paper_memory_note": SEQ1F1B_MEMORY_NOTE}


class TeraPipeScheme(SegmentScheme):
    """TeraPipe (Li et al. 2021): GPipe over (micro-batch, slice) units, DP slicing."""

    options = ("vpp", "seq_segments", "terapipe_slicing")

    @classmethod
    def token_slices(cls, case: CaseConfig) -> list[int]:
        par = case.layout
        opts = case.options.pipeline
        return slices_for(case.model.seq_length, opts.seq_segments, opts.terapipe_slicing,
                          hidden=case.model.hidden_size, stages=par.pp,
                          m=par.num_microbatches)

    def segment_figures(self, p, m, k):
        """The DP's case (Li et al. 2021 Sec. 3.3): the latency under the closed-form slice
        cost for one slice, uniform slices and the DP's, and the simulated bubble of this
        schedule with each slicing's per-unit costs (backward = 2 x forward)."""
        cfg = self.ctx.model
        figures = slicing_figures(cfg.seq_length, k, hidden=cfg.hidden_size, stages=p, m=m)
        cost = SliceCost.for_model(cfg.hidden_size)
        for name in ("uniform", "dp"):
            sim = simulate(self.schedule, cost=unit_cost(figures[f"slices_{name}"], cost))
            figures[f"bubble_sim_slice_costs_{name}"] = sim.bubble
            figures[f"makespan_sim_slice_costs_{name}"] = sim.makespan
        return {"terapipe_slicing": figures}


#: the scheme base of each token-slice schedule (``impls.pipeline`` registers them)
SEGMENT_BASES = {"seq1f1b": Seq1F1BScheme, "terapipe": TeraPipeScheme}
