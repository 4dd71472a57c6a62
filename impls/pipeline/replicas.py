"""The two model replicas of a bidirectional schedule (Chimera: Li and Hoefler 2021, Sec. 3.1;
DualPipe: DeepSeek-AI 2024, Sec. 3.2.2): rank r holds stage r of the down pipe and stage
p-1-r of the up pipe, so every stage has a copy on rank r and one on its *partner* p-1-r.
Each copy's gradient covers the micro-batches of its own pipe; after the schedule the two
partners swap the gradients of their copies and both add them (in the same order, so the two
copies stay bit-identical), and each stage is then reported once, from its pipe-0 copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .weights import StageSlot


def in_exchange_order(slots: dict) -> list[StageSlot]:
    """A rank's two slots in exchange order: (pipe 0, r), (pipe 1, p-1-r)."""
    return [slots[k] for k in sorted(slots)]


def exchange(tensors: list[torch.Tensor], group, peer: int) -> torch.Tensor:
    """Send the concatenation of ``tensors`` to the global rank ``peer``; receive its own."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    other = torch.empty_like(flat)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, flat, peer, group),
                                    dist.P2POp(dist.irecv, other, peer, group)])
    for w in works:
        w.wait()
    return other


def sync_gradients(slots: dict, group, peer: int) -> None:
    """Add the two copies' gradients of every stage (pipe 0 + pipe 1 on both partners)."""
    mine = in_exchange_order(slots)
    other = exchange([p.grad for s in mine for p in s.params], group, peer)
    # the partner sent [(0, p-1-r), (1, r)]: its first part pairs with my (1, p-1-r)
    n_far = sum(p.numel() for p in mine[1].params)
    theirs = {mine[1].stage: other[:n_far], mine[0].stage: other[n_far:]}
    for slot in mine:
        offset, buf = 0, theirs[slot.stage]
        for p in slot.params:
            g = buf[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            p.grad.copy_(p.grad + g if slot.pipe == 0 else g + p.grad)


def reported(slots: dict, group, peer: int, check: bool) -> list[StageSlot]:
    """The slot compared with the reference (the pipe-0 copy), after checking, if asked,
    that the partner's copy of the other stage equals this rank's."""
    mine = in_exchange_order(slots)
    if check:
        from parbench import comm
        with comm.unrecorded():
            other = exchange([p.detach() for s in mine for p in s.params], group, peer)
        n_far = sum(p.numel() for p in mine[1].params)
        far = torch.cat([p.detach().reshape(-1) for p in mine[1].params])
        if not torch.equal(far, other[:n_far]):
            raise RuntimeError(f"the two replicas of stage {mine[1].stage} differ after the "
                               "gradient synchronisation")
    return [mine[0]]
