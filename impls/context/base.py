"""The base of the context-parallel family: the model on a sequence shard.

Every cp rank holds the whole reference model (``build_model``: the same names and weights
as the golden run) and trains on its data-parallel rows and its own tokens of each sample
(``token_positions``, from ``layout``), with the forward of ``shard`` (the position
embeddings of its own tokens; the scheme's distributed attention core, ``build_core``). The
loss is the mean over the rank's tokens, each micro-batch's scaled by 1/m; gradients live in
one flat buffer (``p.grad`` are views into it) that is all-reduced once per step over the
dp x cp ranks (Megatron-Core's ``dp_cp`` group) and divided by cp dp -- every rank holds as
many tokens, so this is the global mean.

With ``loss_mask`` the ranks hold different numbers of counted tokens (a cp rank's shard of
a sample may be all prompt), so a rank's loss is the sum over its counted tokens
(``shard.summed_loss``) times cp dp / N, N the global batch's counted tokens: after the
all-reduce's 1/(cp dp) the gradient is that of the global mean over counted tokens
(Megatron-LM's ``--calculate-per-token-loss``, which all-reduces the count over dp x cp; every
rank holds the global batch here, so N needs no collective). The targets are sharded as the
tokens are (``local_batch``), load-balanced layouts included. A subclass that replaces
``train_step`` does not inherit ``supports_loss_mask``.

With ``clip_grad`` the step clips by global norm after that all-reduce (:meth:`clip`): every
rank then holds the whole model's averaged gradient, identical across dp x cp, so the norm is
the local one and needs no collective (as plain data parallelism; Megatron-LM's
``clip_grad_norm_fp32`` adds nothing over dp / cp for parameters that are neither sharded nor
split over the model-parallel group). A subclass that replaces ``train_step`` (the framework
baselines) does not inherit ``supports_clip_grad``; it declares it if its own step clips.

Packed documents (``pack_docs``): the rank's tokens take their within-document positions
(``docs``) and the core masks attention "causal and same document" with the micro-batch's
documents over the whole sequence (``full_docs``, handed to it by :meth:`bind_documents`).
A class with its own step or forward (a framework's) does not inherit ``supports_packing``.

``recompute`` (``shard``): ``full`` checkpoints each layer, ``selective`` the attention core;
either repeats the core's forward communication in backward.

Measured for the row (``metrics``): each rank's attention-kernel CPU time per step (timeline
spans ``attn``), its imbalance beside the closed form, and the bytes layer 0 keeps for
backward (``SavedActivations``) beside ``analytic.context.cp_layer_activation_bytes``.
"""
from __future__ import annotations

import statistics
from typing import ClassVar

import torch
import torch.distributed as dist

from parbench import comm
from parbench.analytic import shape_from
from parbench.analytic import context as closed
from parbench.batching import dp_slice
from parbench.config import MODEL_FEATURES, CaseConfig, ConfigError
from parbench.memory import SavedActivations
from parbench.model import build_model, counted_tokens, make_optimizer
from parbench.model.packing import documents_of, shard_documents
from parbench.probes import ModuleProbe, microbatch_rows, reference_order
from parbench.scheme import Prediction, Scheme

from impls.common.clip import clip_grads_
from impls.data.buckets import Bucket

from .ring import AttentionClock, RingPeers
from .shard import Tap, embed, mean_loss, shard_forward, summed_loss


class ContextParallelScheme(Scheme):
    family = "context"
    uses = ("cp", "dp")
    options: ClassVar[tuple[str, ...]] = ("recompute",)
    #: the attention algorithm (``analytic.context.KINDS``)
    kind: ClassVar[str] = ""
    #: reads ``cp_balance`` (ring layouts); otherwise the layout is contiguous
    balanced: ClassVar[bool] = False
    #: the ring-neighbour helper the cores use (a class, so that a variant can replace it)
    peers_class: ClassVar[type] = RingPeers
    #: the shared step clips by global norm (:meth:`clip`)
    supports_clip_grad: ClassVar[bool] = True
    #: the shared step normalises a masked loss by the global count (:meth:`loss_scale`)
    supports_loss_mask: ClassVar[bool] = True
    #: the shared forward (``shard.shard_forward``) runs the reference blocks with RoPE at
    #: the tokens' global positions; grouped-query attention with K/V moved at their own
    #: heads (``kernels``: each K/V head serves its query group; the closed forms count
    #: num_kv_heads x head_dim); a core that computes its own scores says it has no "gqa"
    model_features: ClassVar[frozenset] = MODEL_FEATURES
    #: the LLaMA features without grouped-query attention (a core whose kernels move every
    #: head: DistFlashAttn)
    MHA_FEATURES: ClassVar[frozenset] = frozenset({"rope", "swiglu", "rmsnorm", "no-bias"})
    #: reference module name -> probe point (``module_probes``; None: not localising)
    taps: dict | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # a class with its own step clips, or masks its loss, only if it says so; one with
        # its own forward (or a framework's) runs the LLaMA blocks, or packed documents,
        # only if it says so
        own = cls.__dict__
        if "train_step" in own:
            for flag in ("supports_clip_grad", "supports_loss_mask"):
                if flag not in own:
                    setattr(cls, flag, False)
        if "train_step" in own or "forward" in own or getattr(cls, "baseline_of", None):
            for flag, off in (("model_features", frozenset()), ("supports_packing", False)):
                if flag not in own:
                    setattr(cls, flag, off)

    # ---- checks before spawning -------------------------------------------------------------
    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        m = case.model
        if case.run.dtype != "fp32":
            raise ConfigError(f"dtype={case.run.dtype!r} is not supported by {cls.name} "
                              "(fp32 only)")
        if m.num_experts:
            raise ConfigError(f"num_experts={m.num_experts}: {cls.name} runs dense models")
        balance = case.options.context.cp_balance
        if cls.balanced and balance == "zigzag" and m.seq_length % (2 * cls.ring_size(case)):
            raise ConfigError(f"cp_balance='zigzag' needs 2*{cls.ring_size(case)} to divide "
                              f"seq_length={m.seq_length} (2 chunks per ring rank)")

    @classmethod
    def ring_size(cls, case) -> int:
        return case.layout.cp

    @classmethod
    def balance(cls, case) -> str:
        return case.options.context.cp_balance if cls.balanced else "none"

    # ---- construction -------------------------------------------------------------------------
    def __init__(self, ctx):
        super().__init__(ctx)
        mesh = ctx.mesh
        self.cp, self.cp_rank = mesh.size("cp"), mesh.index("cp")
        self.dp, self.dp_rank = mesh.size("dp"), mesh.index("dp")
        self.grad_group = mesh.group("dp_cp")
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.params = list(self.model.parameters())
        self.grads = Bucket(self.params, torch.float32, ctx.device)
        self.opt = self.make_optimizer(self.params)
        self.clock = AttentionClock(ctx.timeline)
        self.core = self.build_core()
        self._activation_bytes: int | None = None
        self._fwd_cp_bytes: float | None = None

    def make_optimizer(self, params):
        return make_optimizer(params, self.ctx.run)

    def build_core(self):
        """The distributed attention: q, k, v (b, n, heads, d) -> (b, n, h)."""
        raise NotImplementedError

    def token_positions(self) -> torch.Tensor:
        """Global positions of this rank's tokens (increasing)."""
        raise NotImplementedError

    # ---- the step -----------------------------------------------------------------------------
    def local_batch(self, inputs, targets):
        """This rank's positions and micro-batches (its dp rows, its tokens of each: targets
        cut as the tokens are); notes the global batch's counted tokens (``loss_scale``)."""
        self.global_tokens = counted_tokens(targets)
        pos = self.token_positions()
        rows = dp_slice(inputs, self.dp_rank, self.dp)
        x = rows[:, pos].to(self.ctx.device)
        y = dp_slice(targets, self.dp_rank, self.dp)[:, pos].to(self.ctx.device)
        m = self.ctx.layout.num_microbatches
        cfg, dev = self.ctx.model, self.ctx.device
        self.mb_docs = [(None if d is None else d.to(dev), None if f is None else f.to(dev))
                        for d, f in ((shard_documents(cfg, r, pos), documents_of(cfg, r))
                                     for r in rows.chunk(m))]
        return pos.to(self.ctx.device), list(zip(x.chunk(m), y.chunk(m)))

    def set_documents(self, i: int | None) -> None:
        """Micro-batch ``i``'s documents for ``forward`` (``docs``: the rank's tokens'
        positions; ``documents_of`` the whole sequences, for a core that masks packed
        documents); None after the step: nothing but model states stays between steps."""
        self.docs, self.full_docs = (None, None) if i is None else self.mb_docs[i]
        if i is None:
            self.mb_docs = None
        self.bind_documents(self.full_docs)

    def bind_documents(self, docs) -> None:
        """Hand the core the micro-batch's packed documents over the whole sequence (None:
        unpacked, or after the step)."""
        self.core.docs = docs

    def train_step(self, inputs, targets, step):
        pos, mbs = self.local_batch(inputs, targets)
        m = len(mbs)
        tl = self.ctx.timeline
        self.grads.reset()
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            self.set_documents(i)
            with tl.span("F", mb=i):
                loss = self.forward(xm, ym, pos, measure=step == 0 and i == 0) * \
                    self.loss_scale(m)
            with tl.span("B", mb=i):
                loss.backward()
            total += float(loss.detach())
        self.set_documents(None)
        self.reduce_gradients()
        with tl.span("optim"):
            self.clip()
            self.opt.step()
        self.clock.end_step(step)
        return self.reduce_loss(total / (self.cp * self.dp), self.grad_group)

    def loss_scale(self, m: int) -> float:
        """What a micro-batch's loss (``forward``) is multiplied by: 1/m of its token mean;
        with ``loss_mask``, cp dp / N of its summed loss (N: the global batch's counted
        tokens), so that after the gradients' all-reduce and 1/(cp dp) the step's gradient
        is that of the global mean over counted tokens (Megatron-LM's
        --calculate-per-token-loss)."""
        if not self.ctx.run.loss_mask:
            return 1.0 / m
        return self.cp * self.dp / self.global_tokens

    def loss_fn(self):
        """The loss of a rank's tokens ``forward`` computes: their mean, or with
        ``loss_mask`` their sum over the counted ones (``shard.summed_loss``)."""
        return summed_loss if self.ctx.run.loss_mask else mean_loss

    def reduce_gradients(self) -> None:
        with self.ctx.timeline.span("grad_allreduce"):
            dist.all_reduce(self.grads.buffer, group=self.grad_group)
            self.grads.buffer.div_(self.cp * self.dp)

    def clip(self) -> None:
        """Clip by global norm (``clip_grad``): the gradients are the reduced, averaged
        ones, the same on every rank, so the local norm is the global one."""
        clip_grads_([p.grad for p in self.params], self.ctx.run.clip_grad)

    def forward(self, tokens, targets, pos, measure: bool = False):
        saved = SavedActivations(exclude=self.params) if measure else None
        loss = shard_forward(self.model, tokens, pos, targets, self.core,
                             self.ctx.options.recompute, saved, self.embed, self.loss_fn(),
                             getattr(self, "docs", None), self.taps)
        if measure:
            self._activation_bytes = saved.bytes
            led = comm.active()
            if led is not None:  # the forward's attention traffic, as the ledger saw it
                self._fwd_cp_bytes = sum(v for a, v in led.wire_by_axis().items()
                                         if a.startswith("cp"))
        return loss

    @staticmethod
    def embed(model, tokens, pos):
        """Token embeddings plus the position embeddings of this rank's tokens."""
        return embed(model, tokens, pos)

    # ---- what the verdict compares --------------------------------------------------------------
    def module_probes(self) -> list[ModuleProbe] | None:
        """The reference modules this rank computes (issue 20, sec. 5): ``embed``, every
        block's ``ln1`` / ``attn`` / ``ln2`` / ``mlp`` and ``head``, through the probe points
        of ``shard`` (installed here), each micro-batch's call on its rows of the rank's dp
        slice at the rank's sequence positions (``token_positions``). A rank's micro-batch
        loss is the mean over its (rows x tokens) -- or with ``loss_mask`` its sum times
        cp dp / N -- so with the sum over the cp ranks its input gradients are cp dp times
        the golden run's (``grad_scale`` 1/(cp dp)). None for the framework baselines,
        whose modules are the framework's."""
        if getattr(self, "baseline_of", None):
            return None
        lay = self.ctx.layout
        self.taps = {name: Tap() for name in reference_order(self.ctx.model.num_layers)}
        rows = lay.global_batch_size // self.dp
        pos = self.token_positions()
        calls = [(r, pos) for r in microbatch_rows(self.dp_rank * rows, rows,
                                                   lay.num_microbatches)]
        return [ModuleProbe(name, tap, list(calls), 1.0 / (self.cp * self.dp))
                for name, tap in self.taps.items()]

    def full_params(self):
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def full_grads(self):
        return {n: p.grad.detach() for n, p in self.model.named_parameters()}

    # ---- closed forms -------------------------------------------------------------------------
    @classmethod
    def cp_ulysses(cls, case) -> int:
        return 1

    @classmethod
    def predict(cls, case: CaseConfig) -> Prediction:
        p, mdl = case.layout, case.model
        shape = shape_from(mdl)
        pred = closed.context_prediction(
            cls.kind, shape, cp=p.cp, dp=p.dp, cp_ulysses=cls.cp_ulysses(case),
            micro_batch_size=p.micro_batch_size, num_microbatches=p.num_microbatches,
            recompute=case.options.recompute, optimizer=case.run.optimizer)
        b = p.micro_batch_size
        figures = dict(pred.figures)
        figures["activation_bytes_per_layer"] = closed.cp_layer_activation_bytes(
            cls.kind, mdl.seq_length, b, mdl.hidden_size, mdl.num_heads, p.cp,
            case.options.recompute, mdl.ffn, kv_hidden=shape.kv_hidden,
            blocks=closed.cp_block_keywords(mdl, mdl.seq_length // p.cp, b))
        figures["attention_work_per_rank"] = cls.predicted_work(case)
        figures["attention_imbalance"] = closed.imbalance(figures["attention_work_per_rank"])
        return Prediction.uniform(p.world_size, pred.wire_bytes, pred.states, pred.calls,
                                  **figures)

    @classmethod
    def predicted_work(cls, case: CaseConfig) -> list[int]:
        """Query-key pairs per cp rank per head and sample (layer, micro-batch)."""
        s, cp = case.model.seq_length, case.layout.cp
        return [s // cp * s] * cp  # every rank evaluates its n x s rows (masked)

    # ---- measurements for the row ---------------------------------------------------------------
    def metrics(self) -> dict:
        run = self.ctx.run
        timed = [c for st, c, _ in self.clock.per_step if st >= run.steps + run.warmup_steps]
        mine = {"cpu_s": statistics.median(timed or [c for _, c, _ in self.clock.per_step]),
                "activation_bytes": self._activation_bytes, "fwd_cp_bytes": self._fwd_cp_bytes}
        every = [None] * dist.get_world_size()
        with comm.unrecorded():
            dist.all_gather_object(every, mine)
        per_cp = [statistics.mean(e["cpu_s"] for r, e in enumerate(every)
                                  if self.ctx.mesh.layout.coords(r)["cp"] == c)
                  for c in range(self.cp)]
        pred = self.predict(self.ctx.case).figures
        out = {"attention_cpu_ms_per_cp_rank": " / ".join(f"{t * 1e3:.2f}" for t in per_cp),
               "attention_imbalance": closed.imbalance(per_cp) if any(per_cp) else None,
               "attention_imbalance_predicted": pred["attention_imbalance"],
               "activation_bytes_per_layer": every[0]["activation_bytes"],
               "activation_bytes_per_layer_predicted": pred["activation_bytes_per_layer"]}
        return out
