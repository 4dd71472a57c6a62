"""Realistic bugs in the data-parallel family: each mutant is a subclass of a native scheme
with one method changed, registered as a scheme of its own (``mutant.<id>``) so that it runs
on the ranks exactly as the original does."""
from __future__ import annotations

import torch
import torch.distributed as dist

from impls.data.ddp import NativeDDP
from impls.data.local_sgd import LocalSGD, is_sync_step, local_step
from impls.zero.replicated import Zero1, Zero2
from impls.zero.sharded import Zero3

from .catalogue import mutant
from .optimizers import make_buggy_optimizer

# ---- DDP -----------------------------------------------------------------------------------


@mutant("ddp-early-bucket", base="data.ddp",
        bug="a bucket is all-reduced when all but one of its gradients have arrived")
class DDPEarlyBucket(NativeDDP):
    def _on_grad(self, p):
        if not self._sync:
            return
        b = self._bucket_of[p]
        b.ready += 1
        if b.ready == max(len(b.params) - 1, 1) and b.work is None:
            b.buffer.div_(self.dp_size)
            b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)


@mutant("ddp-no-divide", base="data.ddp", bug="gradients are summed, not averaged over dp")
class DDPNoDivide(NativeDDP):
    def _on_grad(self, p):
        if not self._sync:
            return
        b = self._bucket_of[p]
        b.ready += 1
        if b.ready == len(b.params):
            b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)


@mutant("ddp-skip-bucket", base="data.ddp", bug="the last bucket is never all-reduced")
class DDPSkipBucket(NativeDDP):
    def _on_grad(self, p):
        if self._bucket_of[p] is self.buckets[-1]:
            return
        super()._on_grad(p)


@mutant("ddp-skip-after-checked", base="data.ddp", overrides={"timed_steps": "2"},
        bug="from step 3 on (the first timed step) the buckets are not all-reduced")
class DDPSkipAfterChecked(NativeDDP):
    """Issue 20: only the checked steps were verified, so this ran 2x faster, 'equivalent'."""

    def train_step(self, inputs, targets, step):
        self._late = step >= 3
        return super().train_step(inputs, targets, step)

    def _on_grad(self, p):
        if not getattr(self, "_late", False):
            super()._on_grad(p)


@mutant("ddp-optimizer-reset-after-checked", base="data.ddp", overrides={"timed_steps": "2"},
        bug="from step 3 on the optimizer is rebuilt without its moments (a resume that "
            "restores the weights only): same traffic, other parameters")
class DDPOptimizerResetAfterChecked(NativeDDP):
    def train_step(self, inputs, targets, step):
        if step == 3:
            self.opt = self.make_optimizer(self.params)
        return super().train_step(inputs, targets, step)


@mutant("ddp-no-wd", base="data.ddp", bug="weight decay dropped")
class DDPNoWeightDecay(NativeDDP):
    def make_optimizer(self, params):
        return make_buggy_optimizer(params, self.ctx.run, "no-wd")


@mutant("ddp-double-wd", base="data.ddp", bug="weight decay applied twice")
class DDPDoubleWeightDecay(NativeDDP):
    def make_optimizer(self, params):
        return make_buggy_optimizer(params, self.ctx.run, "double-wd")


@mutant("ddp-no-bias-correction", base="data.ddp", bug="AdamW without bias correction")
class DDPNoBiasCorrection(NativeDDP):
    def make_optimizer(self, params):
        return make_buggy_optimizer(params, self.ctx.run, "no-bias-correction")


@mutant("ddp-unscaled-microbatch", base="data.ddp", overrides={"num_microbatches": "2"},
        bug="each micro-batch's loss is not scaled by 1/m")
class DDPUnscaledMicrobatch(NativeDDP):
    def train_step(self, inputs, targets, step):
        m = self.ctx.layout.num_microbatches
        for b in self.buckets:
            b.reset()
        total = 0.0
        for i, (xm, ym) in enumerate(self.local_microbatches(inputs, targets)):
            self._sync = i == m - 1
            loss = self.model(xm, ym)  # the bug: / m forgotten
            loss.backward()
            total += float(loss.detach()) / m
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
        self.opt.step()
        return self.reduce_loss(total / self.dp_size, self.group)


# ---- ZeRO-1 / ZeRO-2 -------------------------------------------------------------------------


@mutant("zero1-shard-offset", base="zero.1",
        bug="each rank steps the shard of its neighbour (shard index off by one)")
class Zero1ShardOffset(Zero1):
    def own_slice(self, flat, unit):
        r = (self.dp_rank + 1) % self.dp_size
        return flat[r * unit.shard:(r + 1) * unit.shard]


@mutant("zero1-no-allgather", base="zero.1",
        bug="the updated shards are not all-gathered back after the step")
class Zero1NoAllGather(Zero1):
    def train_step(self, inputs, targets, step):
        m = self.ctx.layout.num_microbatches
        self.gbuf.zero_()
        total = 0.0
        for i, (xm, ym) in enumerate(self.local_microbatches(inputs, targets)):
            self._mb = i
            self._sync = i == m - 1
            self._ready = [0] * len(self._ready)
            loss = self.model(xm, ym) / m
            loss.backward()
            total += float(loss.detach())
        self.wait_reductions()
        self.step_masters()  # the bug: no all-gather of the updated shards follows
        return self.reduce_loss(total / self.dp_size, self.group)


@mutant("zero1-no-wd", base="zero.1", bug="weight decay dropped on the shards")
class Zero1NoWeightDecay(Zero1):
    def make_optimizer(self):
        self.opt = make_buggy_optimizer(self.masters, self.ctx.run, "no-wd")


@mutant("zero2-overwrite-accumulation", base="zero.2", overrides={"num_microbatches": "2"},
        bug="the gradient shard is overwritten, not accumulated, by later micro-batches")
class Zero2Overwrite(Zero2):
    def wait_reductions(self):
        for work, _flat, out, i in self._pending:
            work.wait()
            if out is not self.gshard[i]:
                self.gshard[i].copy_(out)
        self._pending.clear()


@mutant("zero2-no-bias-correction", base="zero.2", bug="AdamW without bias correction")
class Zero2NoBiasCorrection(Zero2):
    def make_optimizer(self):
        self.opt = make_buggy_optimizer(self.masters, self.ctx.run, "no-bias-correction")


# ---- ZeRO-3 ----------------------------------------------------------------------------------


@mutant("zero3-double-wd", base="zero.3", bug="weight decay applied twice on the shards")
class Zero3DoubleWeightDecay(Zero3):
    def make_optimizer(self):
        self.opt = make_buggy_optimizer(self.masters, self.ctx.run, "double-wd")


@mutant("zero3-no-wd", base="zero.3", bug="weight decay dropped on the shards")
class Zero3NoWeightDecay(Zero3):
    def make_optimizer(self):
        self.opt = make_buggy_optimizer(self.masters, self.ctx.run, "no-wd")


@mutant("zero3-no-divide", base="zero.3", bug="reduced gradients not divided by dp")
class Zero3NoDivide(Zero3):
    def step_masters(self):
        for g in self.gshard:
            g.mul_(self.dp_size)  # undoes the division the step applies
        super().step_masters()


@mutant("zero3-overwrite-accumulation", base="zero.3", overrides={"num_microbatches": "2"},
        bug="the gradient shard is overwritten, not accumulated, by later micro-batches")
class Zero3Overwrite(Zero3):
    wait_reductions = Zero2Overwrite.wait_reductions


# ---- local SGD --------------------------------------------------------------------------------


@mutant("local-sgd-late-sync", base="data.local_sgd", overrides={"steps": "4"},
        bug="parameters averaged one step late (off by one in the period)")
class LocalSGDLateSync(LocalSGD):
    def train_step(self, inputs, targets, step):
        return super().train_step(inputs, targets, step - 1 if step else 10**6)


@mutant("local-sgd-sum", base="data.local_sgd", overrides={"steps": "4"},
        bug="parameters summed, not averaged, on a sync step")
class LocalSGDSum(LocalSGD):
    def train_step(self, inputs, targets, step):
        total = local_step(self.model, self.opt, self.grads,
                           self.local_microbatches(inputs, targets))
        if is_sync_step(step, self.ctx.options.data.local_sgd_period):
            dist.all_reduce(self.flat, group=self.group)  # the bug: no division by dp
        return self.reduce_loss(total / self.dp_size, self.group)


# ---- bugs that leave the numbers alone: only the bytes or the model states show them -------


@mutant("ddp-debug-allreduce", base="data.ddp",
        bug="a leftover debugging all-reduce of the loss every step (numbers unchanged)")
class DDPDebugAllReduce(NativeDDP):
    def train_step(self, inputs, targets, step):
        loss = super().train_step(inputs, targets, step)
        probe = torch.tensor([loss])
        dist.all_reduce(probe, group=self.group)  # the bug: traffic the scheme should not make
        return loss


@mutant("zero3-keeps-gathered-units", base="zero.3",
        bug="gathered units are kept after use instead of freed (numbers unchanged)")
class Zero3KeepsGathered(Zero3):
    def _free(self, i):
        full = self._full.get(i)
        if full is not None:
            self.kept = getattr(self, "kept", {})
            self.kept[i] = full  # the bug: a reference outlives the unit's use
        super()._free(i)
