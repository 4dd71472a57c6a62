"""DeepSpeed's pipeline engine (``PipelineModule`` + ``PipelineEngine``, 1F1B) on the same case.

The reference model is laid out as DeepSpeed layers -- embedding, the l blocks, the head
returning logits -- built from the same seeded weights, and partitioned with
``partition_method="type:Block"`` so that stage s holds blocks [s*l/p, (s+1)*l/p) plus the
embedding (first stage) or the head (last stage): exactly ``parbench.model.build_stage``'s
split. DeepSpeed runs its own 1F1B ("TrainSchedule", Narayanan et al. 2021's PipeDream-Flush)
with ``gradient_accumulation_steps = m`` and divides each micro-batch loss by m, then steps a
client torch AdamW (so no fused optimizer is compiled).

What differs from our executor, and why it still equals the golden run: DeepSpeed sends with
blocking ``send``/``recv`` on the default group (so its traffic is recorded on axis
``world``, which here is the pp group: world = pp), exchanges tensor metadata on its first
step only, and broadcasts the two-float loss from the last stage to the other stages every
step on its own pipe group (axis ``other``: 8 bytes). DeepSpeed keeps global process-group
state, so the runner gives this scheme a fresh pool (``isolated``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parbench.analytic.comm import rooted_wire_factor
from parbench.config import CaseConfig, ConfigError
from parbench.memory import KeptForChecks
from parbench.model import build_model, make_optimizer
from parbench.scheme import Scheme, register, registered

from impls.baselines.deepspeed_zero import _import_deepspeed


class EmbedLayer(nn.Module):
    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    def forward(self, tokens):
        return self.embed(tokens)


class BlockLayer(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x)


class HeadLayer(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        return self.head.out(self.head.ln(x))


def _loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@register
class DeepSpeedPipe(Scheme):
    name = "baseline.deepspeed.pipe"
    family = "pipeline"
    baseline_of = "pipeline.1f1b"
    description = "DeepSpeed PipelineModule / PipelineEngine (1F1B TrainSchedule)"
    uses = ("pp",)
    isolated = True

    def __init__(self, ctx):
        super().__init__(ctx)
        deepspeed = _import_deepspeed()
        from deepspeed.pipe import PipelineModule
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
        cfg, par, run = ctx.model, ctx.layout, ctx.run
        full = build_model(cfg, run.seed)
        layers = [EmbedLayer(full.embed)]
        prefixes = ["embed."]
        for i in range(cfg.num_layers):
            layers.append(BlockLayer(full.blocks[str(i)]))
            prefixes.append(f"blocks.{i}.")
        layers.append(HeadLayer(full.head))
        prefixes.append("head.")
        self.pipe = PipelineModule(layers=layers, num_stages=par.pp, loss_fn=_loss,
                                   partition_method="type:BlockLayer",
                                   activation_checkpoint_interval=0)
        lo, hi = self.pipe._local_start, self.pipe._local_stop
        self.local = [(prefixes[i], layers[i]) for i in range(lo, hi)]
        self.pipe.to(ctx.device)
        params = [p for p in self.pipe.parameters() if p.requires_grad]
        self.opt = make_optimizer(params, run)
        # DeepSpeed clears .grad after its step: keep the gradients the step used (checked
        # steps only: the capture stays out of the timed steps)
        self._grads = KeptForChecks()  # the tracker's ``checks``: kept for full_grads only
        self._capture = True
        self.opt.register_step_pre_hook(self._keep_grads)
        config = {"train_batch_size": par.micro_batch_size * par.num_microbatches,
                  "train_micro_batch_size_per_gpu": par.micro_batch_size,
                  "gradient_accumulation_steps": par.num_microbatches,
                  "steps_per_print": 10**9, "wall_clock_breakdown": False,
                  "gradient_clipping": 0.0,
                  "pipeline": {"activation_checkpoint_interval": 0}}
        self.engine, _, _, _ = deepspeed.initialize(model=self.pipe, optimizer=self.opt,
                                                    config=config)
        self._names = [(pre + n, p) for pre, layer in self.local
                       for n, p in _inner(layer).named_parameters()]

    def _keep_grads(self, _opt, _args, _kwargs):
        if self._capture:
            self._grads = KeptForChecks((id(p), p.grad.detach().clone()) for _, p in self._names
                                        if p.grad is not None)

    def train_step(self, inputs, targets, step):
        m = self.ctx.layout.num_microbatches
        dev = self.ctx.device
        data = list(zip(inputs.to(dev).chunk(m), targets.to(dev).chunk(m)))
        self._capture = step < self.ctx.run.steps
        with self.ctx.timeline.span("step"):
            loss = self.engine.train_batch(data_iter=iter(data))
        return float(loss)

    def full_params(self):
        return {n: p.detach() for n, p in self._names}

    def full_grads(self):
        return {n: self._grads[id(p)] for n, p in self._names}

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        p = case.layout
        if p.dp != 1 or p.vpp != 1:
            raise ConfigError(f"dp={p.dp}, vpp={p.vpp}: {cls.name} runs one 1F1B pipeline "
                              "(set dp=1, vpp=1)")
        if p.pp < 2:
            raise ConfigError(f"pp={p.pp}: DeepSpeed's pipeline engine needs pp >= 2")
        if case.model.num_layers % p.pp:
            raise ConfigError(f"pp={p.pp} does not divide num_layers={case.model.num_layers}")
        if case.run.dtype != "fp32":
            raise ConfigError(f"dtype={case.run.dtype!r}: {cls.name} is compared in fp32")

    @classmethod
    def predict(cls, case: CaseConfig):
        """Our 1F1B's figures, with DeepSpeed's p2p on axis world and its 8-byte loss
        broadcast from the last stage over the pipe group (a chain from the root: the rank
        before the root sends nothing; ``analytic.comm.rooted_wire_factor``)."""
        pred = registered(cls.baseline_of).predict(case)
        pp = case.layout.pp
        pred.wire_bytes = [{"world": w.get("pp", 0.0),
                            "other": float(8 * rooted_wire_factor("broadcast", pp, rank,
                                                                  pp - 1))}
                           for rank, w in enumerate(pred.wire_bytes)]
        # one blocking send per message, and every rank of the pipe group in the broadcast
        pred.calls = [{"world": c.get("pp", 0), "other": 1} for c in pred.calls]
        return pred


def _inner(layer: nn.Module) -> nn.Module:
    """The wrapped reference module (names without the wrapper's attribute)."""
    return next(iter(layer.children()))
