"""Tied word embeddings across pipeline stages, kept as Megatron-LM keeps them (Narayanan et
al. 2021, PTD-P; Megatron-LM's embedding group and ``_allreduce_word_embedding_grads``).

With ``tie_embeddings`` the model's token embedding and its output layer are one weight. A
pipeline cuts them apart: the first stage holds the word embedding, the last stage its own
copy as the output layer. The two copies are initialised equal (the last stage's copy is
drawn from the embedding's own seed, so it is bit-identical to it), and after the backward
passes of a step their gradients are summed over the *embedding group* -- the ranks that hold
the first and the last stage of each pipeline -- so both copies take the same optimizer step
and stay equal. When one rank holds both (the V placements; the two-replica schedules, whose
rank r holds stage 0 of one pipe and the last stage of the other, after their replica
exchange) the sum is local and nothing is sent.

Each copy reports itself under the golden run's one name, ``embed.tok.weight``, so the
verdict holds both to the tied gradient: a copy that misses the other's contribution fails.

A stage module names its copies through ``tied_copies``: the reference ``GPTStage`` by its
``embed`` and ``head`` modules; a module of another shape (the hybrid's tensor-parallel
stages, ``impls.hybrid.model``) through its own ``tied_copies()`` method, and initialises its
shard of the copy from ``embedding_init``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parbench.model.init import param_seed

from .weights import StageSlot

#: the mesh axis the embedding group's all-reduce is recorded on (Megatron's ``embd`` group)
EMBD_AXIS = "embd"
EMBED = "embed.tok.weight"
HEAD = "head.out.weight"


def reported_name(name: str, tied: bool) -> str:
    """The golden run's name of a stage parameter: the output layer's copy of a tied weight
    is the word embedding."""
    return EMBED if tied and name == HEAD else name


def holder_kinds(schedule, pp_rank: int) -> set[str]:
    """What rank ``pp_rank`` holds of the tied weight: ``"embed"`` (a first stage) and / or
    ``"head"`` (a last stage), over every pipe of the schedule."""
    kinds = set()
    for _, stage in schedule.stages_of(pp_rank):
        if stage == 0:
            kinds.add("embed")
        if stage == schedule.num_stages - 1:
            kinds.add("head")
    return kinds


def embedding_partition(pp_groups: list[list[int]], schedule, world: int) -> list[list[int]]:
    """The embedding groups of the world: per pipeline, its ranks that hold exactly one of
    the two copies (the first- and last-stage holders); every other rank alone."""
    parts = []
    for ranks in pp_groups:
        parts.append(sorted(ranks[i] for i in range(len(ranks))
                            if len(holder_kinds(schedule, i)) == 1))
    taken = {r for part in parts for r in part}
    return [p for p in parts if p] + [[r] for r in range(world) if r not in taken]


def tied_copies(module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the word embedding, the output layer's copy) that a stage module holds of the tied
    weight, None where it holds no such copy; a stage that holds both ends of the model ties
    them itself (one tensor: the embedding, no copy). A module that is not the reference
    ``GPTStage`` answers through its own ``tied_copies()``."""
    own = getattr(module, "tied_copies", None)
    if callable(own):
        return own()
    embed = module.embed.tok.weight if module.embed is not None else None
    head = module.head.out.weight if module.head is not None and embed is None else None
    return embed, head


def embedding_init(shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """The word embedding's initial (full, fp32) weights, drawn from its own seed as
    ``parbench.model.init`` draws them: what every output-layer copy starts from."""
    g = torch.Generator().manual_seed(param_seed(seed, EMBED))
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


def init_head_copy(slots: list[StageSlot], seed: int, std: float) -> None:
    """Give every last-stage copy the word embedding's initial weights (``embedding_init``),
    so the copies start bit-identical."""
    for slot in slots:
        head = getattr(slot.module, "head", None)
        if head is None or getattr(slot.module, "embed", None) is not None:
            continue  # no output layer here, or a whole model that ties them itself
        w = head.out.weight
        with torch.no_grad():
            w.copy_(embedding_init(tuple(w.shape), seed, std).to(w.device, w.dtype))


class TiedEmbeddings:
    """This rank's copies of the tied weight and how their gradients are summed."""

    def __init__(self, slots: list[StageSlot], schedule, pp_rank: int, mesh):
        # a stage that is both first and last ties its two layers itself (one tensor)
        copies = [tied_copies(s.module) for s in slots]
        self.embeds = [e for e, _ in copies if e is not None]
        self.heads = [h for _, h in copies if h is not None]
        layout = mesh.layout
        parts = embedding_partition(layout.groups("pp"), schedule, layout.world_size)
        # collective: every rank creates the embedding groups, in the same order
        self.group = mesh.subgroup(EMBD_AXIS, parts)
        self.remote = len(holder_kinds(schedule, pp_rank)) == 1 and \
            len(mesh.subgroup_ranks(EMBD_AXIS)) > 1

    def copies(self) -> list[torch.Tensor]:
        return self.embeds + self.heads

    def sync_gradients(self) -> None:
        """Sum the copies' gradients: locally where this rank holds both (embedding first,
        the same order on every rank), else one all-reduce over the embedding group."""
        if self.embeds and self.heads:
            total = self.embeds[0].grad + self.heads[0].grad
            for w in self.copies():
                w.grad.copy_(total)
        elif self.remote:
            (w,) = self.copies()
            dist.all_reduce(w.grad, group=self.group)
