"""``parbench verify scheme=FILE:Class`` with no case field runs the family's default case
set (issue 20, section 2), and that set catches the bug classes users report which the one
small case it ran before let through: gradient accumulation (loss not divided by the
micro-batch count), sequence-parallel LayerNorm gradients not reduced over tp, ZeRO's last
shard mishandled when dp does not divide the parameters, tied embeddings not synchronised
across pipeline stages (also: synchronised across pipelines, visible only with pp x dp), a
masked loss averaged per micro-batch (the features case: a scheme that declares
``supports_loss_mask`` is run with one).
Each bug is a user-style scheme in ``user_schemes/`` beside its correct version, which must
pass (no false alarm). ``test_the_bugs_escape_the_former_single_case`` shows that the set,
not luck, catches them: on the former default case each buggy scheme is equivalent."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

USER = Path(__file__).parent / "user_schemes"

#: (file, the correct class, the buggy class, what every failing case's id shows)
BUGS = [
    ("accumulation.py", "AccumulatingDDP", "UnscaledAccumulation", ":dp"),
    ("zero_padding.py", "PaddedZeRO", "UnevenZeRO", ":dp"),
    ("sp_layernorm.py", "OptionalSP", "SPUnreducedNorms", ":tp2:"),
    ("tied_pipeline.py", "TiedGPipe", "NoTiedSync", "pp2:"),
    ("tied_pipeline.py", "TiedGPipe", "OneEmbeddingGroup", ":dp2-pp2:"),  # pp x dp only
    ("masked_loss.py", "PerTokenDDP", "MeanPerMicrobatch", ":dp2:"),  # the features case
]


def verify(cwd, *args):
    """The installed ``parbench`` script, as a user runs it."""
    script = Path(sys.executable).parent / "parbench"
    return subprocess.run([str(script), "verify", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def _failing_lines(stdout: str) -> list[str]:
    return [x for x in stdout.splitlines() if "NOT equivalent" in x]


def test_verify_with_no_fields_as_a_user_runs_it(tmp_path):
    """One bug class end to end through the installed command: the correct scheme exits 0
    on every default case, the buggy one exits 3 naming step and rank."""
    file, good, bad, where = BUGS[0]
    ok = verify(tmp_path, f"scheme={USER / file}:{good}", f"out={tmp_path / 'ok'}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    n = int(ok.stdout.split("): ")[1].split(" case(s)")[0])
    assert n >= 2 and ok.stdout.count(": equivalent;") == n, ok.stdout
    r = verify(tmp_path, f"scheme={USER / file}:{bad}", f"out={tmp_path / 'bad'}")
    assert r.returncode == 3, r.stdout + r.stderr
    failing = _failing_lines(r.stdout)
    assert failing and all(where in x for x in failing), r.stdout
    first = next(x for x in r.stdout.splitlines() if "first failure" in x)
    assert "step 0, rank" in first, first


#: what the failing case's description shows (``_describe``: fields off their defaults)
SHOWS = {"UnscaledAccumulation": "num_microbatches=", "UnevenZeRO": "dp=",
         "SPUnreducedNorms": "sp=True", "NoTiedSync": "pp=2",
         "OneEmbeddingGroup": "dp=2", "MeanPerMicrobatch": "loss_mask=0.6"}


@pytest.mark.parametrize("file, good, bad, where", BUGS)
def test_the_default_set_catches_each_bug_class(parbench_pool, file, good, bad, where):
    """``assert_equivalent`` with no field runs the same default set as ``verify`` (one
    definition, ``parbench.testing.defaults``) on the session's ranks: the correct
    version passes every case, the buggy one fails at step 0 on a case that shows the
    feature its bug needs."""
    from parbench.testing import NotEquivalent, assert_equivalent
    runs = assert_equivalent(f"{USER / file}:{good}")
    assert len(runs) >= 2
    with pytest.raises(NotEquivalent) as e:
        assert_equivalent(f"{USER / file}:{bad}")
    text = str(e.value)
    assert "first failure: step 0, rank" in text, text
    case_line = next(x for x in text.splitlines() if x.strip().startswith("case:"))
    assert SHOWS[bad] in case_line, case_line


#: the default case of each family before issue 20 (the self-test's base case, one case)
FORMER = {
    "data": dict(model="tiny", dp=2, steps=3, micro_batch_size=2),
    "tensor": dict(model="tiny", tp=2, vocab_size=61, steps=3, micro_batch_size=2,
                   num_microbatches=2),
    "pipeline": dict(model="tiny-4l", pp=2, steps=3, micro_batch_size=1, num_microbatches=4),
}


@pytest.mark.parametrize("file, bad, family", [
    ("accumulation.py", "UnscaledAccumulation", "data"),
    ("zero_padding.py", "UnevenZeRO", "data"),
    ("sp_layernorm.py", "SPUnreducedNorms", "tensor"),
    ("tied_pipeline.py", "NoTiedSync", "pipeline"),
    ("masked_loss.py", "MeanPerMicrobatch", "data"),
])
def test_the_bugs_escape_the_former_single_case(parbench_pool, file, bad, family):
    from parbench.testing import assert_equivalent
    assert_equivalent(f"{USER / file}:{bad}", **FORMER[family])
