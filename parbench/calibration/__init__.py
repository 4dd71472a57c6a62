"""Calibration (``parbench calibrate``): measure this machine (or a cluster node) and make a
device :class:`~parbench.timemodel.profile.Profile` for the time model. It spawns ranks, so it
lives apart from the time model's arithmetic (``parbench.timemodel``), which only reads the
profile.

Every measurement runs on the ranks parbench runs its cases on -- a local ``WorkerPool``
(gloo on CPU with one thread per rank, NCCL on CUDA with one device per rank), or this
process as one rank of a ``torchrun`` / Slurm job -- and on *all ranks at once*, so that the
figures include the contention a real run has (ranks sharing cores, memory bandwidth, a
node's links). Each figure is the median of repeated timings; the slowest rank's median is
kept.

What is measured:

1. **GEMMs** at the model's shapes (when a model is given): for every linear of the reference
   layer (QKV, projection, fc1, fc2, the LM head) at each tensor-parallel split and micro-batch
   size asked for, the forward GEMM and both backward GEMMs (input and weight gradient), plus
   square GEMMs for the peak. Times include the call's fixed cost.
2. **Memory**: a large copy (bandwidth, read + write counted), and the fixed cost of one eager
   operator (a one-element add), of one autograd node in backward and of a ``backward()``
   call (a chain of k scalar multiplies, forward and backward, for two k: the slope and the
   intercept).
3. **Fused attention** (``scaled_dot_product_attention``, causal) forward and backward at the
   model's head shapes, and **AdamW** (``foreach=False``, as parbench runs it) per parameter
   tensor and per element, from two sizes.
4. **Collectives**: all_reduce, all_gather, reduce_scatter, all_to_all on groups of 2..N ranks
   and send/recv between two ranks, each over a sweep of message sizes, fitted with
   ``t = alpha + beta S`` (weighted least squares on the relative error). Each call is issued
   between bursts of a step's compute (the reference layer's forward and backward), the
   burst's own time subtracted: a collective called back to back costs less than one called
   from a busy rank (on a shared CPU, two to three times less). ``instrumented=True`` runs
   them inside a recording ledger with a timeline, as the harness's timed steps do.
5. **Overlap**: an asynchronous all-reduce issued before a GEMM loop of the same length: the
   fraction of the shorter of the two that disappears from the sum.

``plan`` says what is measured, ``compute`` and ``collectives`` what each rank runs,
``timing`` how (``local_model``: the reference layer at a rank's local shapes), ``merge``
makes the ranks' figures a profile, and ``calibrate`` drives it all.
"""
from .calibrate import (add_model_shapes, calibrate, reference_check, run_everywhere,
                        with_links_of)
from .compute import compute_task
from .merge import build_profile, fit_alpha_beta
from .plan import Plan

__all__ = ["Plan", "add_model_shapes", "build_profile", "calibrate", "compute_task",
           "fit_alpha_beta", "reference_check", "run_everywhere", "with_links_of"]
