"""Issue 20, section 1: every step whose figures are reported is verified. A user's ``data.ddp``
subclass that changes behaviour after the checked steps (verify's default case: 3 checked
steps, then 3 timed ones) was reported equivalent, bytes = its closed form, 2x faster; now
``parbench verify`` exits 3 naming the step -- by the timed step's ledger when its traffic
changes, by the final parameters when only its values do -- and the same class without the
change (and data.ddp beside it) passes."""
from __future__ import annotations

import textwrap

import pytest

USER_DDP = textwrap.dedent('''
    from parbench.registry import get_scheme

    SKIP_FROM = {skip_from}
    RESET_AT = {reset_at}


    class FastDDP(get_scheme("data.ddp")):
        """data.ddp that stops all-reducing its buckets from step SKIP_FROM on, and rebuilds
        its optimizer (dropping the moments) at step RESET_AT."""

        def train_step(self, inputs, targets, step):
            self.skip = step >= SKIP_FROM
            if step == RESET_AT:
                self.opt = self.make_optimizer(self.params)
            return super().train_step(inputs, targets, step)

        def _on_grad(self, p):
            if not self.skip:
                super()._on_grad(p)
''')

NEVER = 10**9


@pytest.fixture
def verify(in_process_verify):
    """``parbench verify`` on the session's ranks (``tests/cli/conftest.py``)."""
    return in_process_verify


def first_failure(out: str) -> str:
    return next((x for x in out.splitlines() if "first failure" in x), "")


@pytest.mark.parametrize("name, skip_from, reset_at, says", [
    # the traffic changes at the first timed step: its ledger names it
    ("skips.py", 3, NEVER, "step 3, rank 0: wire bytes on dp: 0 measured"),
    # the traffic stays, the values change: the final parameters name the last step
    ("resets.py", NEVER, 3, "step 5, rank 0: final parameters '"),
])
def test_a_change_after_the_checked_steps_fails_naming_the_step(verify, tmp_path, name,
                                                                 skip_from, reset_at, says):
    (tmp_path / name).write_text(USER_DDP.format(skip_from=skip_from, reset_at=reset_at))
    r = verify(tmp_path, f"scheme={name}:FastDDP", f"out={tmp_path / 'r'}")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "NOT equivalent" in r.stdout
    assert says in first_failure(r.stdout), r.stdout


def test_the_same_class_without_the_change_passes(verify, tmp_path):
    (tmp_path / "steady.py").write_text(USER_DDP.format(skip_from=NEVER, reset_at=NEVER))
    r = verify(tmp_path, "scheme=steady.py:FastDDP", f"out={tmp_path / 'r'}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equivalent" in r.stdout and "NOT equivalent" not in r.stdout
