"""Gradient accumulation over micro-batches: the correct DDP divides each micro-batch's loss
by the number of micro-batches; ``UnscaledAccumulation`` back-propagates the unscaled loss
(the logged loss is still the mean), so its gradients are m times too large -- invisible
with one micro-batch (HF transformers / accelerate, DeepSpeed and NeMo trackers all carry
reports of this kind)."""
import torch.distributed as dist

from parbench import Scheme, build_model, dp_slice, make_optimizer, microbatches


class AccumulatingDDP(Scheme):
    family = "data"
    uses = ("dp",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.group = ctx.mesh.group("dp")
        self.dp, self.index = ctx.mesh.size("dp"), ctx.mesh.index("dp")
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.opt = make_optimizer(self.model.parameters(), ctx.run)

    def scaled(self, loss, m: int):
        """The loss a micro-batch back-propagates."""
        return loss / m

    def train_step(self, inputs, targets, step):
        x, y = dp_slice(inputs, self.index, self.dp), dp_slice(targets, self.index, self.dp)
        mbs = microbatches(x, y, self.ctx.layout.num_microbatches)
        total = 0.0
        for xm, ym in mbs:
            loss = self.model(xm, ym)
            self.scaled(loss, len(mbs)).backward()
            total += loss.item() / len(mbs)
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=self.group)
            p.grad /= self.dp
        self.opt.step()
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.opt.zero_grad(set_to_none=False)
        return self.reduce_loss(total / self.dp, self.group)

    def full_params(self):
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def full_grads(self):
        return self.grads


class UnscaledAccumulation(AccumulatingDDP):
    def scaled(self, loss, m: int):
        return loss  # the bug: summed, not averaged, over the micro-batches
