"""``parbench verify`` on a user's scheme written in a fresh directory with the public API
only: equivalent -> exit 0; a subtle bug -> exit 3 with the failing tensor named; bad input
-> one line, exit 2 before anything is spawned. Also the ``parbench.schemes`` entry points."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import SUBPROCESS_TIMEOUT_S

USER_DDP = textwrap.dedent('''
    import torch.distributed as dist
    from parbench import Scheme, build_model, dp_slice, make_optimizer, microbatches


    class MyDDP(Scheme):
        family = "data"
        uses = ("dp",)

        def __init__(self, ctx):
            super().__init__(ctx)
            self.group = ctx.mesh.group("dp")
            self.dp, self.index = ctx.mesh.size("dp"), ctx.mesh.index("dp")
            self.model = build_model(ctx.model, ctx.run.seed).to(ctx.device)
            self.opt = make_optimizer(self.model.parameters(), ctx.run)

        def train_step(self, inputs, targets, step):
            x = dp_slice(inputs, self.index, self.dp)
            y = dp_slice(targets, self.index, self.dp)
            mbs = microbatches(x, y, self.ctx.layout.num_microbatches)
            total = 0.0
            for xm, ym in mbs:
                loss = self.model(xm, ym) / len(mbs)
                loss.backward()
                total += loss.item()
            for p in self.model.parameters():
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= self.dp  # BUG-SITE
            self.opt.step()
            self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
            self.opt.zero_grad(set_to_none=False)
            return self.reduce_loss(total / self.dp, self.group)

        def full_params(self):
            return {n: p.detach() for n, p in self.model.named_parameters()}

        def full_grads(self):
            return self.grads
''')


def verify(cwd, *args):
    """The installed ``parbench`` script, as a user runs it (the working directory is not on
    its sys.path: verify puts it there, like ``python -m``)."""
    script = Path(sys.executable).parent / "parbench"
    return subprocess.run([str(script), "verify", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S)


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "mine.py").write_text(USER_DDP)
    # the bug: the summed gradients are not averaged over dp
    (tmp_path / "broken.py").write_text(USER_DDP.replace("p.grad /= self.dp  # BUG-SITE",
                                                         "pass"))
    (tmp_path / "raises.py").write_text("raise RuntimeError('cannot import me')\n")
    (tmp_path / "notascheme.py").write_text("class MyDDP:\n    pass\n")
    return tmp_path


def test_verify_a_users_ddp_then_its_bug(user_dir):
    ok = verify(user_dir, "scheme=mine:MyDDP", "suite=smoke", f"out={user_dir / 'r1'}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "equivalent" in ok.stdout and "data.ddp's closed form" in ok.stdout
    # one case (dp=2): the default case set a bare ``verify`` runs is test_verify_defaults'
    bad = verify(user_dir, "scheme=broken.py:MyDDP", "dp=2", f"out={user_dir / 'r2'}")
    assert bad.returncode == 3, bad.stdout + bad.stderr
    assert "NOT equivalent" in bad.stdout
    # the failing step, rank, kind and tensor are named, with the difference and tolerance
    line = next(x for x in bad.stdout.splitlines() if "first failure" in x)
    assert "step 0, rank" in line and "gradient 'blocks." in line and "> tolerance" in line


@pytest.mark.parametrize("spec, says", [
    ("nosuch:MyDDP", "no module named 'nosuch'"),
    ("mine:Nope", "has no attribute 'Nope'"),
    ("raises:X", "raised RuntimeError: cannot import me"),
    ("notascheme:MyDDP", "not a subclass of parbench.Scheme"),
    ("mine", "is not registered"),
])
def test_verify_bad_input_is_one_line_exit_2(user_dir, spec, says):
    r = verify(user_dir, f"scheme={spec}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_entry_points_register_installed_schemes(monkeypatch, user_dir):
    """A package declaring ``[project.entry-points."parbench.schemes"] my-ddp =
    "mine:MyDDP"`` is found by name; a broken entry point is reported when asked for."""
    import importlib.metadata as md

    from parbench import registry, scheme
    from parbench.config import ConfigError

    monkeypatch.syspath_prepend(str(user_dir))
    registry.all_schemes()  # load impls/ first: what the test adds is undone after it
    eps = md.EntryPoints([
        md.EntryPoint("my-ddp", "mine:MyDDP", registry.ENTRY_POINT_GROUP),
        md.EntryPoint("broken-ep", "raises:X", registry.ENTRY_POINT_GROUP)])
    monkeypatch.setattr(md, "entry_points",
                        lambda group=None: eps if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_LOADED", False)
    monkeypatch.setattr(scheme, "SCHEMES", dict(scheme.SCHEMES))
    monkeypatch.setattr(registry, "_BROKEN_ENTRY_POINTS", {})
    cls = registry.get_scheme("my-ddp")
    assert cls.__name__ == "MyDDP" and cls.family == "data"
    with pytest.raises(ConfigError, match="entry point .* failed to load: RuntimeError"):
        registry.get_scheme("broken-ep")
