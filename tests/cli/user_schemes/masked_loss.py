"""A masked loss (prompt tokens left out, ``ignore_index`` -100) over several micro-batches:
the correct DDP scales each micro-batch's mean token loss by its share of the global batch's
counted tokens (Megatron-LM's --calculate-per-token-loss); ``MeanPerMicrobatch`` averages the
micro-batches' means (1/m), which weights a token of a short micro-batch more -- the
gradient-accumulation normalisation bug Hugging Face transformers fixed in 2024 (and that
NeMo, TRL and axolotl trackers report). Invisible without a mask: then every micro-batch
counts the same tokens."""
import torch.distributed as dist

from parbench import Scheme, build_model, dp_slice, make_optimizer, microbatches


def counted(targets) -> int:
    return int((targets != -100).sum())


class PerTokenDDP(Scheme):
    family = "data"
    uses = ("dp",)
    supports_loss_mask = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.group = ctx.mesh.group("dp")
        self.dp, self.index = ctx.mesh.size("dp"), ctx.mesh.index("dp")
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.opt = make_optimizer(self.model.parameters(), ctx.run)

    def scale(self, ym, m: int, total: int) -> float:
        """What a micro-batch's mean loss is multiplied by (gradients averaged over dp)."""
        return counted(ym) * self.dp / total

    def train_step(self, inputs, targets, step):
        total = counted(targets)  # every rank holds the global batch: no collective
        x, y = dp_slice(inputs, self.index, self.dp), dp_slice(targets, self.index, self.dp)
        mbs = microbatches(x, y, self.ctx.layout.num_microbatches)
        loss_sum = 0.0
        for xm, ym in mbs:
            loss = self.model(xm, ym) * self.scale(ym, len(mbs), total)
            loss.backward()
            loss_sum += loss.item()
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=self.group)
            p.grad /= self.dp
        self.opt.step()
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.opt.zero_grad(set_to_none=False)
        return self.reduce_loss(loss_sum / self.dp, self.group)

    def full_params(self):
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def full_grads(self):
        return self.grads


class MeanPerMicrobatch(PerTokenDDP):
    def scale(self, ym, m: int, total: int) -> float:
        return 1.0 / m  # the bug: each micro-batch's mean weighted equally
