"""Rendering results: rich tables per family (compact by default, every column with
``--wide``), a markdown report and figures.

Units: byte figures use binary prefixes (KiB = 2^10, MiB = 2^20, GiB = 2^30). A measured
figure equal to its prediction on every rank is shown once with "=", otherwise both are shown.
"""
from .cells import fmt_bytes
from .figures import figures
from .markdown import markdown, write_report
from .tables import baseline_ratios, print_tables, tables

__all__ = ["baseline_ratios", "figures", "fmt_bytes", "markdown", "print_tables", "tables",
           "write_report"]
