"""``parbench VERB --help``: every verb prints its usage, keys and an example from the one
table, and the keys a verb validates are the keys its help lists."""
from __future__ import annotations

import pytest

from parbench.cli import VERBS, main
from parbench.cli.help import VERBS_HELP, own_keys
from parbench.overrides import field_table


@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_verb_has_help(verb, flag, capsys):
    assert main([verb, flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: parbench {verb}")
    assert "example: parbench " in out and VERBS_HELP[verb].summary in out


def test_help_of_run_lists_every_case_field_by_section(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for f in field_table().values():
        assert f"    {f.name}=" in out, f.name
    for section in ("[model]", "[layout]", "[context]", "[data]", "[run]"):
        assert section in out


def test_every_example_names_a_real_verb_and_real_keys():
    """The examples the help prints parse: a known verb and keys the verb reads."""
    from parbench.overrides import resolve_key
    for verb, h in VERBS_HELP.items():
        words = h.example.split()
        assert words[:2] == ["parbench", verb], verb
        for w in words[2:]:
            key = w.split("=", 1)[0] if "=" in w else None
            if key and key not in h.keys:
                resolve_key(key)  # a case field, or ConfigError


def test_help_verb_and_bare_help(capsys):
    assert main(["help", "plan"]) == 0
    assert capsys.readouterr().out.startswith("usage: parbench plan")
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {v} " in out for v in VERBS)


def test_an_unknown_key_of_plan_lists_the_keys_of_its_help(capsys):
    assert main(["plan", "model=tiny", "world=4", "device=a100-80gb", "wrld=4"]) == 2
    err = capsys.readouterr().err
    assert "wrld: not a key of plan" in err
    assert all(k in err for k in own_keys("plan"))
