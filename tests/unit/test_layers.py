"""The floors of the house, read from the code's own imports (``ast``) and held to DESIGN.md's
"never" list, so that a layering rule cannot break again without a test failing.

Every ``import`` of every module under ``parbench/``, ``impls/`` and ``scripts/`` is read, at
module level and inside function bodies alike (an import inside a function is an arrow all
the same: it only runs later). An arrow A -> B means module A imports module B; importing
``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py`` (implied arrows, followed where
what runs matters: circles and what analytic/ reaches). An import under ``if TYPE_CHECKING:``
never runs: it counts for the never-rules, not for circles. The rules:

- ``parbench/analytic/`` is pure arithmetic: it reaches (directly or through other modules)
  nothing of ``impls/``, the golden run, the reference model, the launcher, the contract, the
  registry, the harness or the runner, and no module it reaches imports ``torch.distributed``;
- ``impls/`` imports nothing from the runner, ``report/`` or ``cli/``;
- ``report/`` imports nothing from ``cli/``;
- ``scheme.py`` (the contract) imports nothing from ``impls/``, ``selftest/`` or the
  registry; the golden run imports neither the contract nor the registry;
- no import circle among modules;
- rooms as the map draws them (each folder right under ``parbench/`` one room, ``impls/`` and
  ``scripts/`` one room each, every other module of ``parbench/`` its own room): a room stands
  above all it imports, so an import that runs back up a floor is an arrow inside a circle of
  rooms; at most one such arrow.

A failure names the file, the line, what it imports and the rule it breaks.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import combinations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("parbench", "impls", "scripts")


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` (dotted module names) at ``path:line``."""

    source: str
    target: str
    path: str
    line: int
    in_function: bool = False
    type_only: bool = False  # under ``if TYPE_CHECKING:``
    implied: bool = False  # a package's ``__init__`` run by importing a module inside it

    def __str__(self) -> str:
        how = (" (inside a function)" if self.in_function else "") + \
            (" (type-checking only)" if self.type_only else "")
        return f"{self.path}:{self.line} imports {self.target}{how}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=1)
def modules() -> dict[str, Path]:
    """Every module of the three trees: dotted name -> file."""
    return {module_name(p): p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))}


def _resolve(dotted: str, known) -> str | None:
    """The longest known module that ``dotted`` names (None: outside the three trees)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Reader(ast.NodeVisitor):
    """The imports of one module: arrows into the trees, and the dotted names outside."""

    def __init__(self, name: str, path: Path, known):
        self.name, self.path, self.known = name, path, known
        self.package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        self.depth = self.typing = 0
        self.arrows: list[Arrow] = []
        self.external: list[tuple[str, int]] = []

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node):
        if not _is_type_checking(node.test):
            return self.generic_visit(node)
        self.typing += 1
        for child in node.body:
            self.visit(child)
        self.typing -= 1
        for child in node.orelse:
            self.visit(child)

    def _asked(self, node) -> list[str]:
        """What the statement imports: for ``from a import b``, ``a.b`` when that is a
        module, else ``a``."""
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = self.package[: len(self.package) - node.level + 1] if node.level else []
        prefix = ".".join(base + ([node.module] if node.module else []))
        subs = [f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in self.known]
        return subs if len(subs) == len(node.names) else subs + [prefix]

    def _import(self, node):
        rel = str(self.path.relative_to(ROOT))
        for dotted in self._asked(node):
            target = _resolve(dotted, self.known)
            if target is None:
                self.external.append((dotted, node.lineno))
            elif target != self.name:
                self.arrows.append(Arrow(self.name, target, rel, node.lineno, self.depth > 0,
                                         self.typing > 0))

    visit_Import = visit_ImportFrom = _import


def read_imports() -> tuple[list[Arrow], dict[str, list[tuple[str, int]]]]:
    """Every arrow among the three trees, and each module's imports from outside them."""
    known = modules()
    arrows, external = [], {}
    for name, path in known.items():
        reader = _Reader(name, path, known)
        reader.visit(ast.parse(path.read_text(), str(path)))
        arrows += reader.arrows
        external[name] = reader.external
    return arrows, external


def with_packages(arrows: list[Arrow]) -> list[Arrow]:
    """``arrows`` and the package ``__init__``s each one runs (not the importer's own)."""
    known = modules()
    out = list(arrows)
    for a in arrows:
        parts = a.target.split(".")
        for n in range(1, len(parts)):
            pkg = ".".join(parts[:n])
            if pkg in known and not (a.source == pkg or a.source.startswith(pkg + ".")):
                out.append(replace(a, target=pkg, implied=True))
    return out


ARROWS, EXTERNAL = read_imports()


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _graph(arrows) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a in arrows:
        out.setdefault(a.source, set()).add(a.target)
        out.setdefault(a.target, set())
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack, on, out = [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def room_of(name: str) -> str:
    """The map's room: a folder right under ``parbench/``, the whole of ``impls/`` and of
    ``scripts/``, or a module of ``parbench/`` itself."""
    parts = name.split(".")
    if parts[0] in ("impls", "scripts"):
        return parts[0] + "/"
    if len(parts) > 1 and (ROOT / "parbench" / parts[1]).is_dir():
        return f"parbench/{parts[1]}/"
    return "/".join(parts) + ".py" if len(parts) > 1 else "parbench/__init__.py"


def room_arrows(arrows) -> dict[tuple[str, str], list[Arrow]]:
    """Arrows between two rooms, as the map draws them (no implied ones; the top-level
    ``__init__``s, which only hand names on, draw none)."""
    out: dict[tuple[str, str], list[Arrow]] = {}
    for a in arrows:
        if a.implied or a.source in ("parbench", "impls"):
            continue
        pair = room_of(a.source), room_of(a.target)
        if pair[0] != pair[1]:
            out.setdefault(pair, []).append(a)
    return out


def arrows_back_up(arrows) -> list[tuple[str, str]]:
    """The fewest room arrows whose removal leaves no circle of rooms: each runs back up a
    floor however the floors are drawn (searched exactly up to two; beyond, every room arrow
    inside a circle)."""
    pairs = room_arrows(arrows)
    graph: dict[str, set[str]] = {}
    for s, t in pairs:
        graph.setdefault(s, set()).add(t)
    found = circles(graph)
    if not found:
        return []
    inside = [(s, t) for comp in found for (s, t) in pairs if s in comp and t in comp]
    for k in (1, 2):
        for chosen in combinations(inside, k):
            if not circles({s: {t for t in ts if (s, t) not in chosen}
                            for s, ts in graph.items()}):
                return list(chosen)
    return inside


# ---- the rules ---------------------------------------------------------------------------

ANALYTIC_NEVER = ("impls", "parbench.golden", "parbench.model", "parbench.launch",
                  "parbench.scheme", "parbench.registry", "parbench.harness", "parbench.runner")
NEVER = [
    # (who, what it may not import, why)
    ("impls", ("parbench.runner", "parbench.report", "parbench.cli"),
     "impls/ imports nothing from the runner, report/ or cli/"),
    ("parbench.report", ("parbench.cli",), "report/ imports nothing from cli/"),
    ("parbench.scheme", ("impls", "parbench.selftest", "parbench.registry"),
     "scheme.py (the contract) imports nothing from impls/, selftest/ or the registry"),
    ("parbench.golden", ("parbench.scheme", "parbench.registry"),
     "the golden run is told the routing groups by its caller; it looks up no scheme"),
]


def _reach(start: str, graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Every module ``start`` reaches, with one import path to it."""
    seen = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(graph.get(v, ())):
            if w not in seen:
                seen[w] = seen[v] + [w]
                todo.append(w)
    return seen


def analytic_breaks(arrows=ARROWS, external=EXTERNAL) -> list[str]:
    """Each analytic module that reaches a forbidden module or torch.distributed, with the
    path and the import that starts it."""
    runs = with_packages(arrows)
    graph = _graph(runs)
    out = []
    for name in sorted(n for n in modules() if _under(n, "parbench.analytic")):
        for reached, path in _reach(name, graph).items():
            first = next((a for a in runs if len(path) > 1 and a.source == name
                          and a.target == path[1]), None)
            via = f"{first} and so reaches" if first else "reaches"
            where = str(modules()[name].relative_to(ROOT))
            if any(_under(reached, bad) for bad in ANALYTIC_NEVER):
                out.append(f"{via} {reached} ({' -> '.join(path)}): analytic/ is pure "
                           "arithmetic, it reaches nothing of impls/, the golden run, the "
                           "model, the launcher, the contract, registry, harness or runner")
            for dotted, line in external.get(reached, []):
                if _under(dotted, "torch.distributed"):
                    out.append(f"{where}: {' -> '.join(path)} imports {dotted} (line {line}): "
                               "analytic/ imports no torch.distributed")
    return out


def never_breaks(arrows=ARROWS) -> list[str]:
    return [f"{a}: {why}" for who, banned, why in NEVER for a in arrows
            if _under(a.source, who) and any(_under(a.target, b) for b in banned)]


def circle_breaks(arrows=ARROWS) -> list[str]:
    runs = [a for a in with_packages(arrows) if not a.type_only]
    lines = []
    for comp in circles(_graph(runs)):
        lines.append("import circle: " + ", ".join(comp))
        lines += [f"  {a}" + (" (runs the package)" if a.implied else "")
                  for a in runs if a.source in comp and a.target in comp]
    return lines


def test_analytic_is_pure_arithmetic():
    breaks = analytic_breaks()
    assert not breaks, "\n".join(breaks)


def test_no_arrow_breaks_a_never_rule():
    breaks = never_breaks()
    assert not breaks, "\n".join(breaks)


def test_no_import_circle():
    breaks = circle_breaks()
    assert not breaks, "\n".join(breaks)


def test_at_most_one_arrow_runs_back_up_a_floor():
    back = arrows_back_up(ARROWS)
    pairs = room_arrows(ARROWS)
    lines = [f"{s} -> {t}: " + "; ".join(str(a) for a in pairs[(s, t)]) for s, t in back]
    assert len(back) <= 1, "arrows that run back up a floor:\n" + "\n".join(lines)


def test_the_reader_sees_function_level_and_relative_imports():
    """The arrows the rules read include imports inside functions and relative ones."""
    assert any(a.in_function for a in ARROWS)
    assert any(a.source == "parbench.registry" and a.target == "impls" for a in ARROWS)
    assert any(a.source == "parbench.golden.store" and a.target == "parbench.golden.run"
               for a in ARROWS)


PLANTED = {
    "analytic": Arrow("parbench.analytic.flops", "impls", "parbench/analytic/flops.py", 1,
                      in_function=True),
    "analytic-deep": Arrow("parbench.analytic.flops", "parbench.comm",
                           "parbench/analytic/flops.py", 1),
    "never": Arrow("impls.data.ddp", "parbench.report", "impls/data/ddp.py", 1),
    "circle": Arrow("parbench.layout", "parbench.config", "parbench/layout.py", 1,
                    in_function=True),
}


@pytest.mark.parametrize("rule", sorted(PLANTED))
def test_the_rules_report_a_planted_import(rule):
    """The rules have power: one planted import of each kind is reported, naming its file
    (``analytic-deep``: comm is allowed in itself, but it imports torch.distributed)."""
    arrows = ARROWS + [PLANTED[rule]]
    if rule.startswith("analytic"):
        found = analytic_breaks(arrows)
    elif rule == "never":
        found = never_breaks(arrows)
    else:
        found = circle_breaks(arrows)
    assert any(PLANTED[rule].path in line for line in found), found
