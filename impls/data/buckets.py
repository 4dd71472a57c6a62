"""Gradient buckets: parameters grouped in reverse order (the order backward produces their
gradients) into flat buffers of at least ``bucket_mb`` MiB (Li et al. 2020, "PyTorch
Distributed", Sec. 3.2.3). ``p.grad`` of every parameter is a view into its bucket, as in
Megatron-Core's contiguous grad buffer."""
from __future__ import annotations

import torch


def bucket_assignment(sizes: list[int], cap_elems: int) -> list[list[int]]:
    """Indices (in reverse order) grouped into buckets of at least ``cap_elems`` elements,
    the last bucket taking the remainder."""
    buckets, cur, cur_n = [], [], 0
    for i in reversed(range(len(sizes))):
        cur.append(i)
        cur_n += sizes[i]
        if cur_n >= cap_elems:
            buckets.append(cur)
            cur, cur_n = [], 0
    if cur:
        buckets.append(cur)
    return buckets


class Bucket:
    """One flat gradient buffer; ``ready`` counts the gradients that have arrived."""

    def __init__(self, params: list[torch.nn.Parameter], dtype, device):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        offset = 0
        for p in params:
            p.grad = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0
        self.work = None

    def reset(self) -> None:
        self.buffer.zero_()
        self.ready, self.work = 0, None
