"""A GPipe pipeline with data parallelism (pp x dp) and tied word embeddings, kept as
Megatron-LM keeps them: the first stage's embedding and the last stage's output layer are
two copies of one weight, initialised equal, whose gradients are all-reduced over the
embedding group -- the first and last stage of *each* pipeline -- after the data-parallel
reduction (Narayanan et al. 2021; Megatron-LM's ``_allreduce_word_embedding_grads``).

``NoTiedSync`` never adds the two copies' gradients: invisible without tied embeddings or
with one stage. ``OneEmbeddingGroup`` puts the first and last stages of every pipeline in
one group, so each copy also adds the other pipelines' (already dp-averaged) copies: correct
with one pipeline, twice the tied gradient with dp = 2 (Megatron-LM, DeepSpeed and NeMo
trackers carry reports of tied-embedding synchronisation bugs).
"""
import torch
import torch.distributed as dist

from parbench import Scheme, build_stage, dp_slice, make_optimizer, microbatches

EMBED, HEAD = "embed.tok.weight", "head.out.weight"


class TiedGPipe(Scheme):
    family = "pipeline"
    uses = ("pp", "dp")

    def __init__(self, ctx):
        super().__init__(ctx)
        mesh, cfg = ctx.mesh, ctx.model
        self.pp, self.stage = mesh.size("pp"), mesh.index("pp")
        self.dp, self.dp_index = mesh.size("dp"), mesh.index("dp")
        self.pp_group, self.dp_group, self.pp_ranks = mesh.group("pp"), mesh.group("dp"), \
            mesh.ranks("pp")
        self.first, self.last = self.stage == 0, self.stage == self.pp - 1
        self.module = build_stage(cfg, ctx.run.seed, self.stage, self.pp).to(ctx.device)
        self.tied = cfg.tie_embeddings and self.pp > 1
        if self.tied:
            self.embd = mesh.subgroup("embd", self.embedding_groups())
            if self.last:  # the output layer starts as the embedding
                embedding = build_stage(cfg, ctx.run.seed, 0, self.pp).embed.tok.weight
                with torch.no_grad():
                    self.module.head.out.weight.copy_(embedding)
        self.opt = make_optimizer(self.module.parameters(), ctx.run)

    def embedding_groups(self) -> list[list[int]]:
        """Per pipeline, its first and last rank; every other rank alone."""
        pairs = [[g[0], g[-1]] for g in self.ctx.layout.groups("pp")]
        inside = {r for p in pairs for r in p}
        return pairs + [[r] for r in range(self.ctx.layout.world_size) if r not in inside]

    def tied_weight(self):
        return self.module.embed.tok.weight if self.first else self.module.head.out.weight

    def sync_tied(self) -> None:
        if self.tied and (self.first or self.last):
            dist.all_reduce(self.tied_weight().grad, group=self.embd)

    def _shape(self, x):
        return (x.shape[0], x.shape[1], self.ctx.model.hidden_size)

    def forward_all(self, mbs):
        """GPipe's forwards: (this stage's inputs, outputs) per micro-batch."""
        saved = []
        for x, y in mbs:
            if self.first:
                inp = x
            else:
                inp = torch.empty(self._shape(x), requires_grad=False)
                dist.recv(inp, self.pp_ranks[self.stage - 1], group=self.pp_group)
                inp.requires_grad_(True)
            out = self.module(inp, y if self.last else None)
            if not self.last:
                dist.send(out.detach(), self.pp_ranks[self.stage + 1], group=self.pp_group)
            saved.append((inp, out))
        return saved

    def backward_all(self, saved, m: int) -> float:
        total = 0.0
        for inp, out in saved:
            if self.last:
                (out / m).backward()
                total += out.item() / m
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, self.pp_ranks[self.stage + 1], group=self.pp_group)
                out.backward(grad)
            if not self.first:
                dist.send(inp.grad, self.pp_ranks[self.stage - 1], group=self.pp_group)
        return total

    def train_step(self, inputs, targets, step):
        x = dp_slice(inputs, self.dp_index, self.dp)
        y = dp_slice(targets, self.dp_index, self.dp)
        mbs = microbatches(x, y, self.ctx.layout.num_microbatches)
        self.opt.zero_grad(set_to_none=False)
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        total = self.backward_all(self.forward_all(mbs), len(mbs))
        if self.dp > 1:
            for p in self.module.parameters():
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad /= self.dp
        self.sync_tied()
        self.opt.step()
        self.grads = {self.name_of(n): p.grad.detach().clone()
                      for n, p in self.module.named_parameters()}
        if self.last:
            return self.reduce_loss(total / self.dp, self.dp_group)
        return None

    def name_of(self, name: str) -> str:
        return EMBED if self.tied and name == HEAD else name

    def full_params(self):
        return {self.name_of(n): p.detach() for n, p in self.module.named_parameters()}

    def full_grads(self):
        return self.grads


class NoTiedSync(TiedGPipe):
    def sync_tied(self) -> None:
        pass  # the bug: the two copies' gradients are never added


class OneEmbeddingGroup(TiedGPipe):
    def embedding_groups(self) -> list[list[int]]:
        # the bug: one group of the first and last ranks of every pipeline
        ends = sorted({r for g in self.ctx.layout.groups("pp") for r in (g[0], g[-1])})
        return [ends] + [[r] for r in range(self.ctx.layout.world_size) if r not in ends]
