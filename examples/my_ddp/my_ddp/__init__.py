"""my_ddp: data parallelism written against parbench's public API.

- ``my_ddp.ddp:MyDDP``: the scheme;
- ``my_ddp.buggy:BuggyDDP``: the same with a subtle bug, which ``parbench verify`` and
  ``parbench.testing.assert_equivalent`` catch.
"""
