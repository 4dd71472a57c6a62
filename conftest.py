"""The test session's time per test directory (issue 24 asks each directory's share of CI):
setup, call and teardown seconds of every test summed by its first two path parts
(``tests/unit``, ``examples/my_ddp``) and printed as a share of the total at the end."""
from __future__ import annotations

from collections import defaultdict

_SECONDS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    parts = report.nodeid.split("::")[0].split("/")
    _SECONDS["/".join(parts[:2]) if len(parts) > 2 else parts[0]] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    total = sum(_SECONDS.values())
    if not total:
        return
    terminalreporter.section("seconds per test directory")
    for where, s in sorted(_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{where:32s} {s:8.1f} s  {s / total:6.1%}")
    terminalreporter.write_line(f"{'all':32s} {total:8.1f} s")
