"""The data-parallel family: DDP with gradient buckets (``ddp``), local SGD (``local_sgd``),
and their shared base (``base``: the dp group, this rank's place in it, its micro-batches).
ZeRO lives in ``impls/zero``."""
