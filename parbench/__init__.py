"""parbench: verify and benchmark parallel training schemes against one golden run."""

__version__ = "0.1.0"
