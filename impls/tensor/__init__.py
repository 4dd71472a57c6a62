"""The tensor-parallel family: Megatron 1D and sequence parallelism (``megatron``, model in
``megatron_model``), 2D / 2.5D SUMMA (``summa``) and 3D (``cube``) tensor parallelism, on the
shared step of ``base``, the parallel layers of ``layers`` and ``collectives``, and the
placements of ``shards``. Predictions: ``parbench.analytic.tensor``."""
