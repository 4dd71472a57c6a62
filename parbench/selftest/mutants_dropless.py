"""Realistic bugs in ``expert.dropless`` (see mutants_expert): the grouped expert
computation's group boundaries, the layout of the received rows, a second counts exchange in
backward. Each replaces one step of :class:`impls.expert.dropless.DroplessDispatch` and
registers as a scheme of its own; all run at capacity factor 0 (the scheme's only setting)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from impls.expert.dropless import DroplessDispatch, ExpertDropless, UnevenAllToAll

from .catalogue import mutant

DROPLESS = {"moe_capacity_factor": "0"}


class _OffsetGroups(DroplessDispatch):
    def group_sizes(self, recv_counts):
        sizes = recv_counts.sum(0).tolist()
        # the bug: group ends taken one row late (an inclusive / exclusive offset mix-up):
        # each expert's group starts one row into the next expert's
        ends = [min(e + 1, sum(sizes)) for e in torch.tensor(sizes).cumsum(0).tolist()]
        ends[-1] = sum(sizes)
        return [b - a for a, b in zip([0] + ends[:-1], ends)]


@mutant("dropless-group-offset", base="expert.dropless", overrides=DROPLESS,
        bug="grouped expert computation with the group boundaries one row late: the first "
            "row of each expert's group is computed by the previous expert")
class GroupOffsetByOne(ExpertDropless):
    dispatch_class = _OffsetGroups


class _SenderLayout(DroplessDispatch):
    @staticmethod
    def expert_major(recv_counts):
        # the bug: the received rows taken as already expert-major (the sender's sorted
        # layout) -- no permutation from source-major
        return torch.arange(int(recv_counts.sum()), device=recv_counts.device)


@mutant("dropless-recv-layout", base="expert.dropless", overrides=DROPLESS,
        bug="received rows grouped in the sender's layout (expert-major) instead of "
            "source-major: rows from one peer are computed by another local expert")
class ReceivedInSenderLayout(ExpertDropless):
    dispatch_class = _SenderLayout


class _RecountInBackward(UnevenAllToAll):
    @staticmethod
    def backward(ctx, grad):
        # the bug: the splits re-derived in backward with a fresh counts exchange
        counts = torch.tensor(ctx.recv, dtype=torch.int64)
        dist.all_to_all_single(torch.empty_like(counts), counts, group=ctx.group)
        return UnevenAllToAll.backward(ctx, grad)


class _Recount(DroplessDispatch):
    tokens_fn = _RecountInBackward


@mutant("dropless-recount-backward", base="expert.dropless", overrides=DROPLESS,
        bug="a counts all-to-all repeated in the backward of every token exchange (the "
            "splits re-derived instead of kept from forward): results unchanged, two extra "
            "calls per MoE layer and micro-batch")
class RecountInBackward(ExpertDropless):
    dispatch_class = _Recount
