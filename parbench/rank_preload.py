"""Imported once by the rank fork server (``parbench.rank_start``): the one-thread defaults
first (libgomp reads them when torch loads it), then what every rank imports."""
from __future__ import annotations

from .worker import _setup_env

_setup_env(1, "cpu-or-cuda")

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

from . import comm, harness  # noqa: E402,F401
import impls  # noqa: E402,F401
