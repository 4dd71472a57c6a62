"""Native ZeRO-3 (P_os+g+p) (Rajbhandari et al. 2020, Sec. 5.3 and 7.2.2).

Each rank holds only its shard of every unit (``impls/zero/layout``) -- parameters, gradients
and AdamW states. A unit's parameters are all-gathered right before the unit runs in forward
(the next unit's gather is issued before this one computes: prefetch), used, and freed; they
are all-gathered again when backward reaches the unit (again prefetching the unit before it),
and the unit's gradients are reduce-scattered as soon as its backward is done, then the
gathered parameters are freed. Traffic per micro-batch: all-gather forward + all-gather
backward + reduce-scatter = 3 Psi' (Sec. 7.2.2: 1.5x the 2 Psi of ZeRO-1/2 and DDP).

Mechanics: the layers of a unit run through ``torch.func.functional_call`` with views of the
gathered buffer as their parameters. Those views come out of ``_UnitParams``, an autograd
function whose backward receives the unit's parameter gradients and reduce-scatters them.
Autograd would keep the gathered parameters alive until backward (ops save their weights);
a ``saved_tensors_hooks`` pair replaces every saved tensor that lives in a gathered buffer by
a (unit, offset, size, stride) record and rebuilds it from the re-gathered buffer in backward,
so nothing holds a unit's full parameters between its forward and its backward.
"""
from __future__ import annotations

from functools import partial

import torch
from torch.func import functional_call

from parbench.config import CaseConfig, ConfigError
from parbench.model import documents_of
from parbench.scheme import register

from .base import ZeroScheme, all_gather_into, split_units, unit_views
from .layout import model_layers


class _Saved:
    __slots__ = ("unit", "offset", "size", "stride")

    def __init__(self, unit, offset, size, stride):
        self.unit, self.offset, self.size, self.stride = unit, offset, size, stride


class _UnitParams(torch.autograd.Function):
    """shard -> views of the unit's gathered parameters; backward reduce-scatters their
    gradients (the scheme keeps them; nothing flows back into the shard leaf)."""

    @staticmethod
    def forward(ctx, shard, owner, i):
        ctx.owner, ctx.i = owner, i
        return tuple(unit_views(owner._full[i], owner.units[i]))

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner._reduce_grads(ctx.i, grads)
        return None, None, None


@register
class Zero3(ZeroScheme):
    name = "zero.3"
    family = "data"
    uses = ("dp",)
    stage = 3
    description = "ZeRO-3: parameters, gradients and optimizer states partitioned"

    @classmethod
    def check(cls, case: CaseConfig) -> None:
        super().check(case)
        if case.model.tie_embeddings:
            raise ConfigError("tie_embeddings=True is not supported by zero.3 (the tied weight "
                              "would belong to two units); set tie_embeddings=false")

    def __init__(self, ctx):
        super().__init__(ctx)
        dev = ctx.device
        model = self.model
        layers = dict(model_layers(model))
        named = dict(model.named_parameters())
        self.shards = []
        for u in self.units:
            full = torch.zeros(u.padded, dtype=torch.float32, device=dev)
            for n, view in zip(u.names, unit_views(full, u)):
                view.copy_(named[n].detach())
            own = self.own_slice(full, u).clone()
            shard = own.to(self.dtype) if self.mixed else own
            self.shards.append(torch.nn.Parameter(shard))  # this rank's shard of the weights
            if self.mixed:
                self.masters.append(own)
        if not self.mixed:
            self.masters = self.shards
        self.owned = self.shards
        # the layers keep only their structure: their own parameters are emptied
        for p in model.parameters():
            p.data = torch.empty(0, dtype=self.dtype, device=dev)
        self.unit_layers = [[(ln, layers[ln]) for ln in u.layers] for u in self.units]
        self.rel_names = []  # per unit, per layer: (relative names, index range in unit)
        for u in self.units:
            per, k = [], 0
            for ln in u.layers:
                names = [n[len(ln) + 1:] for n in u.names if n.startswith(ln + ".")]
                per.append((names, k, k + len(names)))
                k += len(names)
            self.rel_names.append(per)
        self.model = model.to(self.dtype)
        self.gbuf = torch.zeros(self.layout.shard_total, dtype=self.dtype, device=dev)
        self.gshard = split_units(self.gbuf, [u.shard for u in self.units])
        self.make_optimizer()
        self._full: dict[int, torch.Tensor] = {}
        self._gathering: dict[int, tuple] = {}
        self._live: dict[int, int] = {}  # data_ptr of a gathered buffer -> unit

    # ---- gathering and freeing ------------------------------------------------------------
    def _launch(self, i: int) -> None:
        if i in self._full or i in self._gathering or not 0 <= i < len(self.shards):
            return
        u = self.units[i]
        full = torch.empty(u.padded, dtype=self.dtype, device=self.ctx.device)
        work = all_gather_into(full, self.shards[i].detach(), self.group, True)
        self._gathering[i] = (full, work)

    def _ensure(self, i: int) -> torch.Tensor:
        if i not in self._full:
            self._launch(i)
            full, work = self._gathering.pop(i)
            work.wait()
            self._full[i] = full
            self._live[full.untyped_storage().data_ptr()] = i
        return self._full[i]

    def _free(self, i: int) -> None:
        full = self._full.pop(i, None)
        if full is not None:
            self._live.pop(full.untyped_storage().data_ptr(), None)

    def _pack(self, t: torch.Tensor):
        i = self._live.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if i is None:
            return t
        return _Saved(i, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, s):
        if not isinstance(s, _Saved):
            return s
        return self._ensure(s.unit).as_strided(s.size, s.stride, s.offset)

    def _pre_backward(self, i: int, grad=None):
        """Backward reaches unit i: its parameters must be there; prefetch unit i - 1."""
        self._ensure(i)
        self._launch(i - 1)
        return None

    def _reduce_grads(self, i: int, grads) -> None:
        """Unit i's backward is done: flatten its gradients, reduce-scatter, free the unit."""
        u = self.units[i]
        flat = torch.empty(u.padded, dtype=self.dtype, device=self.ctx.device)
        for g, o, n in zip(grads, u.offsets, u.sizes()):
            flat[o:o + n].copy_(g.reshape(-1))
        flat[u.numel:].zero_()
        self.reduce_unit(i, flat)
        self._free(i)

    # ---- the step -------------------------------------------------------------------------
    def _run_unit(self, i: int, views, h, targets, docs):
        """Unit ``i``'s layers on ``h``: the head takes the targets, the embedding and the
        blocks the micro-batch's packed documents (None: unpacked)."""
        for (ln, mod), (names, a, b) in zip(self.unit_layers[i], self.rel_names[i]):
            params = dict(zip(names, views[a:b]))
            h = functional_call(mod, params, (h, targets if ln == "head" else docs))
        return h

    def _forward(self, xm, ym):
        n = len(self.shards)
        h, docs = xm, documents_of(self.ctx.model, xm)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            for i in range(n):
                self._ensure(i)
                self._launch(i + 1)  # prefetch the next unit
                views = _UnitParams.apply(self.shards[i], self, i)
                h = self._run_unit(i, views, h, ym, docs)
                del views
                self._free(i)
                if i < n - 1 and h.requires_grad:
                    h.register_hook(partial(self._pre_backward, i))
        return h

    def train_step(self, inputs, targets, step):
        m = self.ctx.layout.num_microbatches
        mbs = self.local_microbatches(inputs, targets)
        self.gbuf.zero_()
        tl = self.ctx.timeline
        total = 0.0
        for i, (xm, ym) in enumerate(mbs):
            self._mb = i
            with tl.span("F", mb=i):
                loss = self._forward(xm, ym) * self.loss_scale(ym)
            with tl.span("B", mb=i):
                self._pre_backward(len(self.shards) - 1)
                loss.backward()
            total += float(loss.detach())
            with tl.span("wait", mb=i):
                self.wait_reductions()
            self._full.clear()
            self._live.clear()
        with tl.span("optim"):
            self.step_masters()
        return self.reduce_loss(total / self.dp_size, self.group)

    # ---- comparison and accounting ---------------------------------------------------------
    def full_params(self):
        return self.gather(self.masters)

