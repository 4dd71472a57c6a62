"""ZeRO-1 over one flat buffer of every parameter. ``PaddedZeRO`` pads the buffer with zeros
to a multiple of dp, so every rank owns an equal shard and one all-gather returns all of
them. ``UnevenZeRO`` gives the remainder of numel / dp to the last rank instead and gathers
equal shards only: the last rank updates its extra elements, the other ranks never receive
them -- invisible while dp divides the parameter count (DeepSpeed and FSDP trackers carry
padding / uneven-shard bugs of this kind)."""
import torch
import torch.distributed as dist

from parbench import Scheme, build_model, dp_slice, make_optimizer, microbatches


class PaddedZeRO(Scheme):
    family = "data"
    uses = ("dp",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.group = ctx.mesh.group("dp")
        self.dp, self.index = ctx.mesh.size("dp"), ctx.mesh.index("dp")
        self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
        self.params = list(self.model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.lo, self.hi = self.bounds()
        self.master = torch.nn.Parameter(self.flat(self.params)[self.lo:self.hi].clone())
        self.opt = make_optimizer([self.master], ctx.run)

    def bounds(self) -> tuple[int, int]:
        """This rank's slice of the flat buffer (padded to dp equal shards)."""
        self.shard = -(-self.numel // self.dp)
        return self.index * self.shard, (self.index + 1) * self.shard

    def flat(self, tensors) -> torch.Tensor:
        out = torch.zeros(self.shard * self.dp)
        out[:self.numel] = torch.cat([t.detach().reshape(-1) for t in tensors])
        return out

    def gather(self, shard: torch.Tensor, into: torch.Tensor) -> None:
        """Every rank's shard into the flat buffer ``into``."""
        dist.all_gather_into_tensor(into[:self.shard * self.dp], shard[:self.shard].contiguous(),
                                    group=self.group)

    def unflat(self, flat: torch.Tensor, tensors) -> None:
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def train_step(self, inputs, targets, step):
        x, y = dp_slice(inputs, self.index, self.dp), dp_slice(targets, self.index, self.dp)
        mbs = microbatches(x, y, self.ctx.layout.num_microbatches)
        total = 0.0
        for xm, ym in mbs:
            loss = self.model(xm, ym) / len(mbs)
            loss.backward()
            total += loss.item()
        grads = self.flat([p.grad for p in self.params])
        dist.all_reduce(grads, group=self.group)
        grads /= self.dp
        self.master.grad = grads[self.lo:self.hi].clone()
        self.opt.step()
        new = self.flat(self.params)
        new[self.lo:self.hi] = self.master.detach()
        self.gather(self.master.detach(), new)
        self.unflat(new, self.params)
        self.grads = grads
        for p in self.params:
            p.grad = None
        return self.reduce_loss(total / self.dp, self.group)

    def full_params(self):
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def full_grads(self):
        out, offset = {}, 0
        for n, p in self.model.named_parameters():
            out[n] = self.grads[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return out


class UnevenZeRO(PaddedZeRO):
    def bounds(self) -> tuple[int, int]:
        """Equal shards of numel // dp; the last rank also takes the remainder."""
        self.shard = self.numel // self.dp
        lo = self.index * self.shard
        return lo, self.numel if self.index == self.dp - 1 else lo + self.shard

    def flat(self, tensors) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    # the bug: ``gather`` (inherited) moves shard elements from each rank, so the last rank's
    # remainder never reaches the others
