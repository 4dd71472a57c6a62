"""What each wrapped function moves: its first tensor, message bytes, group, peer and root,
read from the arguments of torch 2.13's signatures (``torch.distributed`` and the functional
collectives)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

# ---- the wrappers ---------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


class _PerGroup:
    """Facts fixed for a group's life, asked on every recorded call: kept by ``id`` beside a
    weak reference to the group (a hit is the same live group; a dead group's entry is
    replaced when its id returns). A plain dict get: ``WeakKeyDictionary.get`` is Python
    code, a few microseconds a call on the ledger's path."""

    def __init__(self, compute):
        self._compute = compute
        self._by_id: dict[int, tuple] = {}

    def get(self, group, *key):
        hit = self._by_id.get(id(group))
        if hit is None or hit[0]() is not group:
            hit = self._by_id[id(group)] = (weakref.ref(group), {})
        values = hit[1]
        if key not in values:
            values[key] = self._compute(group, *key)
        return values[key]


_GROUP_INFO = _PerGroup(lambda g: (_group_size(g), dist.get_rank(g)))
_GLOBAL_RANK = _PerGroup(dist.get_global_rank)


def _group_info(group) -> tuple[int, int]:
    """(size, this rank's group rank) of ``group`` (None: the world), cached per group."""
    if group is None:
        return dist.get_world_size(), dist.get_rank()
    return _GROUP_INFO.get(group)


@dataclass
class _Call:
    """What a wrapped call moves: its first tensor, message bytes, group, peer and root (both
    global ranks, or None)."""

    tensor: torch.Tensor
    message_bytes: int
    group: object
    peer: int | None = None
    root: int | None = None
    #: an all-to-all's bytes kept by this rank (its own block), when the splits are uneven;
    #: the wire bytes are then message_bytes - kept (None: even blocks, (n-1)/n S)
    kept_bytes: int | None = None


def _arg(args, kwargs, i, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _global_peer(group, peer, group_peer):
    """A peer given as a global rank, or as a rank inside ``group``, as a global rank."""
    if peer is not None:
        return peer
    if group_peer is None:
        return None
    return _GLOBAL_RANK.get(group, group_peer) if group is not None else group_peer


def _sum_bytes(tensors) -> int:
    return sum(_nbytes(t) for t in tensors)


# torch.distributed (c10d): argument positions follow torch 2.13's signatures


def _all_reduce(*a, **k):
    t = _arg(a, k, 0, "tensor")
    return _Call(t, _nbytes(t), _arg(a, k, 2, "group"))


def _all_gather_into(*a, **k):
    out = _arg(a, k, 0, "output_tensor")
    return _Call(out, _nbytes(out), _arg(a, k, 2, "group"))


def _all_gather_list(*a, **k):
    lst = _arg(a, k, 0, "tensor_list")
    return _Call(lst[0], _sum_bytes(lst), _arg(a, k, 2, "group"))


def _all_gather_coalesced(*a, **k):
    outs = _arg(a, k, 0, "output_tensor_lists")
    flat = [t for lst in outs for t in lst]
    return _Call(flat[0], _sum_bytes(flat), _arg(a, k, 2, "group"))


def _reduce_scatter_input(*a, **k):
    inp = _arg(a, k, 1, "input")
    return _Call(inp, _nbytes(inp), _arg(a, k, 3, "group"))


def _reduce_scatter_list(*a, **k):
    lst = _arg(a, k, 1, "input_list")
    return _Call(lst[0], _sum_bytes(lst), _arg(a, k, 3, "group"))


def _reduce(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 3, "group")
    return _Call(t, _nbytes(t), group,
                 root=_global_peer(group, _arg(a, k, 1, "dst"), k.get("group_dst")))


def _all_reduce_coalesced(*a, **k):
    lst = _arg(a, k, 0, "tensors")
    return _Call(lst[0], _sum_bytes(lst), _arg(a, k, 2, "group"))


def _all_to_all_single(*a, **k):
    """(output, input, output_split_sizes, input_split_sizes, group): with input splits, this
    rank sends everything but its own block (uneven splits: MoE dispatch, context parallel's
    one-peer exchanges)."""
    inp, group = _arg(a, k, 1, "input"), _arg(a, k, 4, "group")
    return _Call(inp, _nbytes(inp), group,
                 kept_bytes=_kept(inp, _arg(a, k, 3, "input_split_sizes"), group))


def _kept(inp: torch.Tensor, splits, group) -> int | None:
    """The bytes of an all-to-all's input that stay on this rank (its own split), or None
    when the input is cut into equal blocks."""
    if not splits:
        return None
    me = _group_info(group)[1]
    row = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else 0
    return int(splits[me]) * row


def _all_to_all_list(*a, **k):
    lst = _arg(a, k, 1, "input_tensor_list")
    return _Call(lst[0], _sum_bytes(lst), _arg(a, k, 2, "group"))


def _broadcast(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 2, "group")
    return _Call(t, _nbytes(t), group,
                 root=_global_peer(group, _arg(a, k, 1, "src"), k.get("group_src")))


def _gather(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 3, "group")
    n = _group_size(group)
    return _Call(t, _nbytes(t) * n, group,
                 root=_global_peer(group, _arg(a, k, 2, "dst"), k.get("group_dst")))


def _scatter(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 3, "group")
    n = _group_size(group)
    return _Call(t, _nbytes(t) * n, group,
                 root=_global_peer(group, _arg(a, k, 2, "src"), k.get("group_src")))


def _send(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 2, "group")
    return _Call(t, _nbytes(t), group,
                 peer=_global_peer(group, _arg(a, k, 1, "dst"), k.get("group_dst")))


def _recv(*a, **k):
    t, group = _arg(a, k, 0, "tensor"), _arg(a, k, 2, "group")
    return _Call(t, _nbytes(t), group,
                 peer=_global_peer(group, _arg(a, k, 1, "src"), k.get("group_src")))


def _barrier(*a, **k):
    return _Call(torch.empty(0), 0, _arg(a, k, 0, "group"))


C10D_WRAPPERS = [
    ("all_reduce", "all_reduce", _all_reduce),
    ("all_gather_into_tensor", "all_gather", _all_gather_into),
    ("all_gather_single", "all_gather", _all_gather_into),
    ("all_gather", "all_gather", _all_gather_list),
    ("all_gather_coalesced", "all_gather", _all_gather_coalesced),
    ("reduce_scatter_single", "reduce_scatter", _reduce_scatter_input),
    ("reduce_scatter_tensor", "reduce_scatter", _reduce_scatter_input),
    ("reduce_scatter", "reduce_scatter", _reduce_scatter_list),
    ("reduce", "reduce", _reduce),
    ("all_reduce_coalesced", "all_reduce", _all_reduce_coalesced),
    ("all_to_all_single", "all_to_all", _all_to_all_single),
    ("all_to_all", "all_to_all", _all_to_all_list),
    ("broadcast", "broadcast", _broadcast),
    ("gather", "gather", _gather),
    ("scatter", "scatter", _scatter),
    ("send", "send", _send),
    ("isend", "send", _send),
    ("recv", "recv", _recv),
    ("irecv", "recv", _recv),
    ("barrier", "barrier", _barrier),
]


# functional collectives: (tensor, ..., group, tag); ``group`` is a process group, a list of
# ranks, a (DeviceMesh, dim) pair or a group name


def _functional_group(group):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(funcol._resolve_group_name(group))


def _functional(tensor_pos: int, group_pos: int, scale=None):
    def size_of(*a, **k):
        t = a[tensor_pos] if len(a) > tensor_pos else next(iter(k.values()))
        group = _functional_group(_arg(a, k, group_pos, "group"))
        ts = list(t) if isinstance(t, (list, tuple)) else [t]
        nbytes = _sum_bytes(ts)
        if scale == "group":  # all-gather: the message is the gathered output
            nbytes *= _group_size(group)
        return _Call(ts[0], nbytes, group)
    return size_of


def _functional_all_to_all(*a, **k):
    """funcol.all_to_all_single(self, output_split_sizes, input_split_sizes, group, tag)."""
    inp = a[0] if a else k["self"]
    group = _functional_group(_arg(a, k, 3, "group"))
    return _Call(inp, _nbytes(inp), group,
                 kept_bytes=_kept(inp, _arg(a, k, 2, "input_split_sizes"), group))


FUNCTIONAL_WRAPPERS = [
    ("all_reduce", "all_reduce", _functional(0, 2)),
    ("all_reduce_coalesced", "all_reduce", _functional(0, 2)),
    ("all_gather_tensor", "all_gather", _functional(0, 2, "group")),
    ("all_gather_single", "all_gather", _functional(0, 2, "group")),
    ("all_gather_tensor_autograd", "all_gather", _functional(0, 2, "group")),
    ("all_gather_single_autograd", "all_gather", _functional(0, 2, "group")),
    ("all_gather_into_tensor_coalesced", "all_gather", _functional(0, 1, "group")),
    ("all_gather_single_coalesced", "all_gather", _functional(0, 1, "group")),
    ("reduce_scatter_single_autograd", "reduce_scatter", _functional(0, 3)),
    ("reduce_scatter_single_coalesced", "reduce_scatter", _functional(0, 3)),
    ("reduce_scatter_tensor", "reduce_scatter", _functional(0, 3)),
    ("reduce_scatter_single", "reduce_scatter", _functional(0, 3)),
    ("reduce_scatter_tensor_autograd", "reduce_scatter", _functional(0, 3)),
    ("all_to_all_single", "all_to_all", _functional_all_to_all),
    ("all_to_all_single_autograd", "all_to_all", _functional_all_to_all),
]


def _shard_dim_alltoall_size(*a, **k):
    """DTensor's Shard -> Shard all-to-all: on CPU it falls back to an all-gather, recorded
    inside; elsewhere it is one all-to-all of the local shard."""
    t = _arg(a, k, 0, "input")
    mesh, dim = _arg(a, k, 3, "mesh"), _arg(a, k, 4, "mesh_dim")
    if mesh.device_type == "cpu":
        return None
    return _Call(t, _nbytes(t), mesh.get_group(dim))
