"""Lets the tests import ``my_ddp`` from this directory without installing the package (as
parbench's CI runs them: ``python -m pytest`` from the repository root). Installed
(``pip install -e .``), the package is found anyway.

Nothing else is needed: parbench's pytest plugin (fixture ``parbench_pool``) is loaded by
its ``pytest11`` entry point wherever parbench is installed.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
