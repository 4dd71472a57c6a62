"""Issue 20, section 5: a failing case names its first diverging module. ``parbench verify``
on a user's ``data.ddp`` subclass whose second replica builds one LayerNorm with another eps
names that module's forward output on that rank and step; a subclass that sums its buckets
instead of averaging them (every module computes what the golden run does) says that no
module diverges, so the difference arises in the reduction; the correct class is not
localised at all (it passes)."""
from __future__ import annotations

import textwrap

import pytest

HEADER = textwrap.dedent('''
    import torch.distributed as dist
    from parbench.registry import get_scheme
''')

LN_EPS = HEADER + textwrap.dedent('''
    class MyDDP(get_scheme("data.ddp")):
        def __init__(self, ctx):
            super().__init__(ctx)
            if self.dp_rank == 1:
                self.model.blocks["1"].ln2.eps = 1e-3
''')

SUMMED = HEADER + textwrap.dedent('''
    class MyDDP(get_scheme("data.ddp")):
        def _on_grad(self, p):
            if not self._sync:
                return
            b = self._bucket_of[p]
            b.ready += 1
            if b.ready == len(b.params):
                b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)
''')

CASE = ("dp=2", "model=tiny", "steps=2", "timed_steps=0", "num_microbatches=2")


@pytest.fixture
def verify(in_process_verify):
    """``parbench verify`` on the session's ranks (``tests/cli/conftest.py``)."""
    return in_process_verify


@pytest.mark.parametrize("source, says", [
    (LN_EPS, "first divergence: forward output of blocks.1.ln2 (rank 1, step 0)"),
    (SUMMED, "first divergence: none in the mapped modules"),
])
def test_a_failing_case_names_its_first_diverging_module(verify, tmp_path, source, says):
    (tmp_path / "mine.py").write_text(source)
    r = verify(tmp_path, "scheme=mine.py:MyDDP", *CASE, f"out={tmp_path / 'r'}")
    assert r.returncode == 3, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "first failure" in x)
    assert says in line, r.stdout


PIPE_LN_EPS = HEADER + textwrap.dedent('''
    class MyPipe(get_scheme("pipeline.1f1b")):
        def __init__(self, ctx):
            super().__init__(ctx)
            for slot in self.slots.values():
                if "3" in slot.module.blocks:
                    slot.module.blocks["3"].ln1.eps = 1e-3
''')

PIPE_CASE = ("pp=2", "model=tiny-4l", "steps=2", "timed_steps=0", "num_microbatches=4",
             "micro_batch_size=1")


def test_a_pipeline_stage_names_its_first_diverging_module(verify, tmp_path):
    """The second stage (rank 1, layers 2-3) computes blocks.3.ln1 with another eps: its
    forward output on that rank is named, though rank 0's stage and every gradient the
    loss sends back through rank 0 differ too (issue 20, sec. 5)."""
    (tmp_path / "mine.py").write_text(PIPE_LN_EPS)
    r = verify(tmp_path, "scheme=mine.py:MyPipe", *PIPE_CASE, f"out={tmp_path / 'r'}")
    assert r.returncode == 3, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "first failure" in x)
    assert "first divergence: forward output of blocks.3.ln1 (rank 1, step 0)" in line, r.stdout


EXPERT_LN_EPS = HEADER + textwrap.dedent('''
    class MyExperts(get_scheme("expert.alltoall")):
        def __init__(self, ctx):
            super().__init__(ctx)
            if self.dp_rank == 1:
                self.model.blocks["1"].ln2.eps = 1e-3
''')


def test_an_expert_parallel_rank_names_its_first_diverging_module(verify, tmp_path):
    """The expert family maps its modules as the data family does (MoE layers included):
    rank 1's blocks.1.ln2 is named, not the MoE layer after it, whose all-to-alls carry the
    wrong rows to rank 0 too."""
    (tmp_path / "mine.py").write_text(EXPERT_LN_EPS)
    r = verify(tmp_path, "scheme=mine.py:MyExperts", "dp=2", "ep=2", "num_experts=4",
               "model=tiny", "steps=2", "timed_steps=0", "num_microbatches=2",
               f"out={tmp_path / 'r'}")
    assert r.returncode == 3, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "first failure" in x)
    assert "first divergence: forward output of blocks.1.ln2 (rank 1, step 0)" in line, r.stdout


TP_FC2_UNREDUCED = HEADER + textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from impls.tensor.megatron_model import MegatronGPT

    class PartialFc2(MegatronGPT):
        def mlp(self, i, x):
            if i != 1:
                return super().mlp(i, x)
            pre = f"blocks.{i}.mlp"
            u = F.gelu(self.column(x, self.p(f"{pre}.fc1.weight"), self.bias(f"{pre}.fc1.bias")))
            # layer 1's fc2 keeps the rank's partial sum: its all-reduce (g) is forgotten
            return torch.matmul(u, self.p(f"{pre}.fc2.weight").t()) + self.bias(f"{pre}.fc2.bias")

    class MyTP(get_scheme("tensor.megatron")):
        model_cls = PartialFc2

    class Correct(get_scheme("tensor.megatron")):
        pass
''')

SP_LN_EPS = HEADER + textwrap.dedent('''
    from parbench.model.blocks import NORM_EPS
    import torch.nn.functional as F
    from impls.tensor.megatron_model import MegatronGPT

    class WideEps(MegatronGPT):
        def layer_norm(self, x, prefix):
            if prefix != "blocks.0.ln2" or self.rank != 1:
                return super().layer_norm(x, prefix)
            shape = (self.cfg.hidden_size,)  # rank 1's shard of this norm: another eps
            return F.layer_norm(x, shape, self.p(f"{prefix}.weight"),
                                self.p(f"{prefix}.bias"), eps=1e-3)

    class MySP(get_scheme("tensor.megatron-sp")):
        model_cls = WideEps
''')

TP_CASE = ("tp=2", "model=tiny", "vocab_size=61", "steps=2", "timed_steps=0",
           "num_microbatches=2")


@pytest.mark.parametrize("source, cls, extra, says", [
    (TP_FC2_UNREDUCED, "MyTP", (), "forward output of blocks.1.mlp (rank 0, step 0)"),
    (SP_LN_EPS, "MySP", ("pack_docs=3",), "forward output of blocks.0.ln2 (rank 1, step 0)"),
])
def test_a_tensor_parallel_layer_is_named(verify, tmp_path, source, cls, extra, says):
    """Megatron's model maps the reference modules (issue 20, sec. 5): whole on every tp
    rank after the row-parallel all-reduce, the rank's sequence shard under sp. One layer
    computed otherwise -- every rank's MLP of layer 1, rank 1's shard of a norm under sp
    (packed: its rows' documents) -- is named, not the modules after it."""
    (tmp_path / "mine.py").write_text(source)
    r = verify(tmp_path, f"scheme=mine.py:{cls}", *TP_CASE, *extra, f"out={tmp_path / 'r'}")
    assert r.returncode == 3, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "first failure" in x)
    assert f"first divergence: {says}" in line, r.stdout


def test_a_correct_tensor_parallel_subclass_reports_nothing(verify, tmp_path):
    (tmp_path / "mine.py").write_text(TP_FC2_UNREDUCED)
    r = verify(tmp_path, "scheme=mine.py:Correct", *TP_CASE, f"out={tmp_path / 'r'}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "first divergence" not in r.stdout and "first failure" not in r.stdout, r.stdout


CP_LN_EPS = HEADER + textwrap.dedent('''
    class MyRing(get_scheme("context.ring-attention")):
        def __init__(self, ctx):
            super().__init__(ctx)
            if self.cp_rank == 1:
                self.model.blocks["1"].ln2.eps = 1e-3
''')

CP_NO_RESCALE = HEADER + textwrap.dedent('''
    import torch
    from impls.context.ring import RingPeers

    class NoRescale(RingPeers):
        def merge(self, out, lse, blk_out, blk_lse):
            new = torch.logaddexp(lse, blk_lse)
            out.add_(blk_out * torch.exp(blk_lse - new).unsqueeze(-1))  # rows not rescaled
            lse.copy_(new)

    class MyRing(get_scheme("context.ring-attention")):
        peers_class = NoRescale

    class Correct(get_scheme("context.ring-attention")):
        pass
''')

CP_CASE = ("cp=2", "model=tiny", "cp_balance=none", "steps=2", "timed_steps=0",
           "num_microbatches=2")


@pytest.mark.parametrize("source, extra, says", [
    (CP_LN_EPS, (), "forward output of blocks.1.ln2 (rank 1, step 0)"),
    (CP_NO_RESCALE, ("pack_docs=3",), "forward output of blocks.0.attn (rank 1, step 0)"),
])
def test_a_context_parallel_rank_names_its_first_diverging_module(verify, tmp_path, source,
                                                                   extra, says):
    """The context family maps the reference modules on each rank's sequence positions
    (issue 20, sec. 5): cp rank 1's norm of layer 1 with another eps is named, not the MLP
    and head after it nor rank 0's gradients, which rank 1's loss reaches through the ring;
    a ring merge that does not rescale its rows is named as layer 0's attention on rank 1
    (contiguous layout: rank 0 attends to its own block only and merges nothing)."""
    (tmp_path / "mine.py").write_text(source)
    r = verify(tmp_path, "scheme=mine.py:MyRing", *CP_CASE, *extra, f"out={tmp_path / 'r'}")
    assert r.returncode == 3, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "first failure" in x)
    assert f"first divergence: {says}" in line, r.stdout


def test_a_correct_context_parallel_subclass_reports_nothing(verify, tmp_path):
    (tmp_path / "mine.py").write_text(CP_NO_RESCALE)
    r = verify(tmp_path, "scheme=mine.py:Correct", *CP_CASE, "pack_docs=3",
               f"out={tmp_path / 'r'}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "first divergence" not in r.stdout and "first failure" not in r.stdout, r.stdout


DFA_REMAT = HEADER + textwrap.dedent('''
    from parbench.selftest.mutants_distflash import DFARematStaleCheckpoint

    class LnEps(get_scheme("context.distflashattn")):
        def __init__(self, ctx):
            super().__init__(ctx)
            if self.cp_rank == 1:
                self.model.blocks["1"].ln2.eps = 1e-3

    class Stale(DFARematStaleCheckpoint):
        pass

    class Correct(get_scheme("context.distflashattn")):
        pass
''')

DFA_CASE = ("cp=2", "model=tiny", "recompute=full", "steps=2", "timed_steps=0",
            "num_microbatches=2")


@pytest.mark.parametrize("cls, says", [
    ("LnEps", "first divergence: forward output of blocks.1.ln2 (rank 1, step 0)"),
    ("Stale", "first divergence: forward output of blocks.0.attn (rank 0, step 0)"),
    ("Correct", None),
])
def test_distflashattn_remat_layers_are_probed(verify, tmp_path, cls, says):
    """DistFlashAttn's rematerialised layers (``recompute=full``) map the reference modules
    through probe points in their backward's recomputation (issue 20, sec. 5): cp rank 1's
    norm of layer 1 with another eps is named; a checkpoint that hands micro-batch 1 the
    first micro-batch's attention output is named as layer 0's attention on rank 0; the
    correct class passes, not localised."""
    (tmp_path / "mine.py").write_text(DFA_REMAT)
    r = verify(tmp_path, f"scheme=mine.py:{cls}", *DFA_CASE, f"out={tmp_path / 'r'}")
    if says is None:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "first divergence" not in r.stdout and "first failure" not in r.stdout
        return
    assert r.returncode == 3, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "first failure" in x)
    assert says in line, r.stdout
