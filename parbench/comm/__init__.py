"""Instrumented collectives and the traffic ledger: one per process, every thread, every op.

``install()`` wraps, once per process, the public ``torch.distributed`` collective and
point-to-point functions and the functional collectives (``torch.distributed.
_functional_collectives``, which DTensor calls in forward and in its redistribute backward).
While a ``Ledger`` is active every call is recorded, whichever thread makes it (autograd runs
backward on device threads on CUDA, so gradient hooks issue collectives off the main thread)
and whoever makes it: our schemes, DeepSpeed (``deepspeed.comm`` forwards to these functions),
FSDP2, DTensor and ``torch.distributed.pipelining``. ``unrecorded()`` pauses recording for
traffic that is not the scheme's (checks, metrics, loss reporting).

What "wire bytes" assumes, per op, on a group of n ranks with an S-byte message (S: the full
message -- the reduced buffer, the *gathered* output, the full input of a reduce-scatter, one
rank's whole send buffer of an all-to-all; see ``parbench.analytic.comm``):

============================  =================================================================
all_reduce                    2(n-1)/n S (ring: reduce-scatter then all-gather)
all_gather, reduce_scatter    (n-1)/n S (ring)
all_to_all                    S minus the rank's own block: (n-1)/n S with even blocks; with
                              input splits, the bytes addressed to the other ranks
broadcast                     S on every rank but the last of the chain from the root, 0 there
reduce                        S on every rank but the root (chain towards the root), 0 there
gather                        S/n on every non-root rank, 0 on the root
scatter                       (n-1)/n S on the root, 0 elsewhere
send / recv                   S on the sender, 0 on the receiver (peer: the global rank)
barrier                       0
============================  =================================================================

Torch DDP's C++ reducer calls the process group directly; its baseline routes the buckets
through ``all_reduce`` in its checked steps only (``impls/baselines/torch_ddp``).
"""
from .install import install
from .ledger import Ledger
from .recording import CommRecord, active, record_wire, set_status_sink, unrecorded

__all__ = ["CommRecord", "Ledger", "active", "install", "record_wire", "set_status_sink",
           "unrecorded"]
