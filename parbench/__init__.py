"""parbench: verify and benchmark parallel training schemes against one golden run.

The public API for writing a scheme of your own (see the README, "Your own scheme"):

    from parbench import Scheme, SchemeContext, Prediction, register
    from parbench import build_model, make_optimizer, dp_slice, microbatches, unrecorded
"""

__version__ = "0.1.0"

_PUBLIC = {
    "Scheme": "scheme", "SchemeContext": "scheme", "Prediction": "scheme", "register": "scheme",
    "get_scheme": "registry", "build_model": "model", "build_stage": "model",
    "make_optimizer": "model", "dp_slice": "batching", "microbatches": "batching",
    "unrecorded": "comm", "CaseConfig": "config", "ConfigError": "config",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """Import on first use, so ``import parbench`` stays light (no torch until needed)."""
    if name in _PUBLIC:
        import importlib
        return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module 'parbench' has no attribute {name!r}")
