"""torch.distributed.pipelining's schedules on the same stages, group and case as ours.

``baseline.torch.pipelining.<gpipe|1f1b|interleaved|zb-interleaved|zbv|dualpipev>`` wrap
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble and ScheduleDualPipeV. Each rank builds the same
``parbench.model.build_stage`` modules our executor runs (loop placement, stage s on rank
s % p, for the interleaved schedules; V placement, stages r and 2p-1-r on rank r, for ZBV and
DualPipeV), wraps each in a ``PipelineStage`` over the pp group with static shapes, and lets
torch's schedule run the step. The last stage returns logits and torch applies the same
mean token cross-entropy; torch divides the accumulated gradients by m (``scale_grads``),
so the update equals the full-batch mean gradient's, as ours does.

torch's point-to-point calls go through ``torch.distributed.isend/irecv`` (as
``batch_isend_irecv`` P2POps), so they land in parbench's ledger on axis pp. Its first step
also exchanges a few small warm-up / metadata messages; the steps after carry only the
activations and gradients. The timeline records each stage forward (module hooks) and the
optimizer; torch's backward ops are not split into spans.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from parbench.config import CaseConfig, ConfigError
from parbench.model import build_stage, make_optimizer
from parbench.schedules import Placement
from parbench.scheme import Scheme, register, registered

#: our name -> (torch schedule class name, our matching scheme, stage placement)
TORCH_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "pipeline.gpipe", Placement.LINEAR),
    "1f1b": ("Schedule1F1B", "pipeline.1f1b", Placement.LINEAR),
    "interleaved": ("ScheduleInterleaved1F1B", "pipeline.interleaved", Placement.LOOPED),
    "zb-interleaved": ("ScheduleInterleavedZeroBubble", "pipeline.zb-h1", Placement.LOOPED),
    "zbv": ("ScheduleZBVZeroBubble", "pipeline.zbv", Placement.V),
    "dualpipev": ("ScheduleDualPipeV", "pipeline.dualpipev", Placement.V),
}


class _LogitsStage(nn.Module):
    """A GPTStage whose last stage returns logits (torch applies the loss)."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.gpt = stage

    def forward(self, x):
        g = self.gpt
        if g.embed is not None:
            x = g.embed(x)
        for blk in g.blocks.values():
            x = blk(x)
        if g.head is not None:
            x = g.head.out(g.head.ln(x))
        return x


def _loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _stage_indices(placement: Placement, p: int, v: int, rank: int) -> list[int]:
    if placement is Placement.LINEAR:
        return [rank]
    if placement is Placement.LOOPED:
        return [c * p + rank for c in range(v)]
    return [rank, 2 * p - 1 - rank]


class TorchPipelining(Scheme):
    family = "pipeline"
    uses = ("pp",)
    options = ("vpp",)
    torch_name = ""

    def __init__(self, ctx):
        super().__init__(ctx)
        from torch.distributed import pipelining as tpp
        cfg, par, run = ctx.model, ctx.layout, ctx.run
        cls_name, _, placement = TORCH_SCHEDULES[self.torch_name]
        self.group = ctx.mesh.group("pp")
        p, rank = ctx.mesh.size("pp"), ctx.mesh.index("pp")
        v = self.num_chunks(ctx.case)
        S = p * v
        b, s, h = par.micro_batch_size, cfg.seq_length, cfg.hidden_size
        self.mods, stages = [], []
        for idx in _stage_indices(placement, p, v, rank):
            mod = _LogitsStage(build_stage(cfg, run.seed, idx, S)).to(ctx.device)
            first, last = idx == 0, idx == S - 1
            inp = torch.zeros(b, s, dtype=torch.long, device=ctx.device) if first else \
                torch.zeros(b, s, h, device=ctx.device, requires_grad=True)
            out = torch.zeros(b, s, cfg.vocab_size if last else h, device=ctx.device,
                              requires_grad=True)
            stages.append(tpp.PipelineStage(mod, idx, S, ctx.device, input_args=(inp,),
                                            output_args=(out,), group=self.group))
            self.mods.append(mod)
            self._hook(mod, idx)
        sched_cls = getattr(tpp, cls_name)
        m = par.num_microbatches
        self.torch_schedule = sched_cls(stages[0] if placement is Placement.LINEAR else stages,
                                        m, loss_fn=_loss)
        self.has_first = any(mod.gpt.first for mod in self.mods)
        self.has_last = any(mod.gpt.last for mod in self.mods)
        self.params = [p_ for mod in self.mods for p_ in mod.parameters()]
        self.opt = make_optimizer(self.params, run)
        torch.distributed.barrier(group=self.group)

    def _hook(self, mod, idx):
        tl = self.ctx.timeline

        def pre(_m, _a):
            self._t0 = time.perf_counter()

        def post(_m, _a, _o):
            tl.add("F", self._t0, time.perf_counter(), stage=idx)
        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)

    @classmethod
    def num_chunks(cls, case: CaseConfig) -> int:
        placement = TORCH_SCHEDULES[cls.torch_name][2]
        if placement is Placement.LINEAR:
            return 1
        if placement is Placement.V:
            return 2
        return case.layout.vpp

    def train_step(self, inputs, targets, step):
        dev = self.ctx.device
        self.opt.zero_grad(set_to_none=False)
        losses: list = []
        args = (inputs.to(dev),) if self.has_first else ()
        kwargs = {"target": targets.to(dev), "losses": losses} if self.has_last else {}
        self.torch_schedule.step(*args, **kwargs)
        with self.ctx.timeline.span("optim"):
            self.opt.step()
        total = sum(float(x.detach()) for x in losses) / self.ctx.layout.num_microbatches \
            if self.has_last else 0.0
        return self.reduce_loss(total, self.group)

    def full_params(self):
        return {n: p.detach() for mod in self.mods for n, p in mod.gpt.named_parameters()}

    def full_grads(self):
        return {n: p.grad.detach() for mod in self.mods for n, p in mod.gpt.named_parameters()}

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        if case.run.dtype != "fp32":  # its stages train the fp32 reference model
            raise ConfigError(f"dtype={case.run.dtype!r}: {cls.name} runs fp32")
        par = case.layout
        if par.dp != 1:
            raise ConfigError(f"dp={par.dp}: pipeline baselines run one pipeline (set dp=1)")
        placement = TORCH_SCHEDULES[cls.torch_name][2]
        if placement is Placement.LINEAR and par.vpp != 1:
            raise ConfigError(f"vpp={par.vpp}: {cls.name} holds one stage per rank (set vpp=1)")
        if placement is Placement.V and par.vpp not in (1, 2):
            raise ConfigError(f"vpp={par.vpp}: {cls.name} always holds 2 stages per rank")
        S = par.pp * cls.num_chunks(case)
        if case.model.num_layers % S:
            raise ConfigError(f"num_layers={case.model.num_layers} is not divisible by the "
                              f"{S} stages of {cls.name}")
        if placement is Placement.V and par.num_microbatches < S:
            raise ConfigError(f"num_microbatches={par.num_microbatches}: {cls.name} needs "
                              f"m >= 2p = {S}")
        registered(cls.baseline_of)

    @classmethod
    def predict(cls, case: CaseConfig):
        """The matching native schedule's figures (same stages, same transfers)."""
        return registered(cls.baseline_of).predict(case)


def _register():
    out = {}
    for name, (torch_class, ours, _) in TORCH_SCHEDULES.items():
        cls = type(f"TorchPipelining_{name.replace('-', '_')}", (TorchPipelining,), {
            "name": f"baseline.torch.pipelining.{name}", "torch_name": name,
            "baseline_of": ours,
            "description": f"torch.distributed.pipelining {torch_class}",
            "__module__": __name__})
        out[name] = register(cls)
        globals()[cls.__name__] = cls
    return out


SCHEMES = _register()
