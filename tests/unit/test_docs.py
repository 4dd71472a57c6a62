"""README.md is the front door and docs/ the manual: every relative link resolves (file and
heading), no link leaves the repository, the README stays short, it states the test command
that CI runs, and the commands the pages show name real verbs and suites."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: [text](target) outside code; images too
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def code_blocks(text: str) -> list[str]:
    return [m.group(0) for m in FENCE.finditer(text)]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def test_the_pages_exist():
    names = {p.name for p in PAGES}
    assert "README.md" in names
    for topic in ("verdict", "suites", "own-scheme", "timemodel", "clusters", "architecture"):
        assert f"{topic}.md" in names, f"docs/{topic}.md is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_and_none_leaves_the_repository(page):
    found = links(page)
    bad = []
    for target in found:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:, file:
            bad.append(f"{target}: leaves the repository")
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(bad)
    # bare addresses in the text are external links too
    assert not re.search(r"https?://", prose(page.read_text())), page


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines (at most 260)"
    readme_links = {t.partition("#")[0] for t in links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme_links, f"README.md does not link docs/{page.name}"


def test_no_heading_names_an_internal_issue():
    internal = re.compile(r"\bissue\s*#?\d+|\b(first|second|third|next) wave\b|\bwave\s*\d|"
                          r"\bstop\s*\d+|\bsession\b", re.IGNORECASE)
    for page in PAGES:
        for line in prose(page.read_text()).splitlines():
            if line.startswith("#"):
                assert not internal.search(line), f"{page.name}: {line}"


def test_readme_states_the_test_command_that_ci_runs():
    """The second set-up command is the one `.ci/run` runs, character for character."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = [line for line in ci if "pytest" in line]
    assert len(command) == 1, ci
    blocks = [b.splitlines()[1:-1] for b in code_blocks((ROOT / "README.md").read_text())]
    assert [command[0]] in blocks, "README.md does not show .ci/run's command as its own block"


#: a fenced block and its language
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
#: a parbench command inside a line: the verb and its arguments
COMMAND = re.compile(r"(?:^|[\s'(])(?:parbench|-m parbench\.cli) ([a-z]\S*)(.*)")


def shown_commands() -> list[tuple[str, list[str]]]:
    """Every parbench command the pages show: the lines of bash blocks, and the lines that
    start with a prompt ``$`` in output blocks, as (page, [verb, args...])."""
    out = []
    for page in PAGES:
        for lang, body in FENCED.findall(page.read_text()):
            for line in body.splitlines():
                if lang != "bash":
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
                for m in COMMAND.finditer(line):
                    args = m.group(2).split(" #")[0].split(" && ")[0].split()
                    out.append((page.name, [m.group(1), *args]))
    return out


def test_the_commands_shown_name_real_verbs_and_suites():
    from parbench.cli import VERBS
    from parbench.suites import available_suites

    suites = set(available_suites()) | {"papers"}
    commands = shown_commands()
    assert len(commands) > 20
    for page, argv in commands:
        assert argv[0] in VERBS, f"{page}: parbench {' '.join(argv)}: no verb {argv[0]!r}"
        for arg in argv[1:]:
            if arg.startswith("suite=") and "$" not in arg and "<" not in arg:
                name = arg.split("=", 1)[1]
                assert name in suites or name in ("NAME",), f"{page}: {arg}"


def test_every_suite_has_its_section():
    from parbench.suites import available_suites

    text = (ROOT / "docs" / "suites.md").read_text()
    for name in available_suites():
        assert f"| `{name}` |" in text and f"\n## {name}\n" in text, name


#: what `run` and `verify` take beside the case's fields
VERB_OPTIONS = {"suite", "out", "resume", "world_size", "deepspeed_config", "model",
                "strict_bytes"}


def test_the_run_commands_shown_use_real_fields():
    """`parbench run` / `verify` commands of the pages name fields that exist (bare, an
    alias, or section.field), so a renamed field cannot stay in the manual."""
    from parbench.overrides import ALIASES, field_table

    table = field_table()
    for page, argv in shown_commands():
        if argv[0] not in ("run", "verify"):
            continue
        for arg in argv[1:]:
            key = arg.split("=", 1)[0]
            if "=" not in arg or key in VERB_OPTIONS or key in ALIASES:
                continue
            section, _, bare = key.rpartition(".")
            assert bare in table, f"{page}: parbench {' '.join(argv)}: no field {bare!r}"
            if section and section != "parallel":
                assert table[bare].section == section, f"{page}: {arg}: {bare} is in " \
                                                       f"{table[bare].section}"


#: settable fields the manual leaves out on purpose: testing aids and the preset's label
UNDOCUMENTED = {"name", "fail_at_step", "fail_rank", "fail_kind"}


def test_the_key_table_lists_every_field_in_its_section():
    from parbench.overrides import SECTIONS, field_table

    text = (ROOT / "docs" / "commands.md").read_text()
    rows = {sec: cell for sec, cell in re.findall(r"^\| `(\w+)` \| (.*) \|$", text, re.MULTILINE)
            if sec in SECTIONS}
    assert set(rows) == set(SECTIONS), f"key table sections {sorted(rows)} != {SECTIONS}"
    documented = {name: sec for sec, cell in rows.items()
                  for name in re.findall(r"`(\w+)`", cell)}
    table = field_table()
    for name, sec in documented.items():
        assert name in table, f"docs/commands.md lists {name!r}, which is not a field"
        assert table[name].section == sec, f"{name} is in {table[name].section}, not {sec}"
    missing = set(table) - set(documented) - UNDOCUMENTED
    assert not missing, f"docs/commands.md's key table lacks {sorted(missing)}"
