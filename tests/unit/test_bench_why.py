"""The measured reason of a pair where ours is slower (``parbench.bench_why``): the calling
thread's CPU and the backend threads' per side, and the collectives each side issued."""
from __future__ import annotations

from types import SimpleNamespace

from parbench.bench_pairs import PairResult, goals
from parbench.bench_why import backend_bound, cpu_split, explain
from parbench.results import Traffic


def _row(own, threads, calls=26, wire=1024.0):
    return SimpleNamespace(time=SimpleNamespace(own_cpu_s=own, threads_cpu_s=threads),
                           traffic=Traffic(wire=[{"tensor": wire}], calls=[{"tensor": calls}]))


def test_less_own_work_on_the_same_collectives_is_the_backends():
    ours = [_row(9.0, {"gloo_tcp_loop": 24.0, "pt_gloo_runloop": 7.0}) for _ in range(3)]
    theirs = [_row(10.0, {"gloo_tcp_loop": 20.0, "pt_gloo_runloop": 7.0, "x": 0.1})] * 3
    split = cpu_split(ours, theirs)
    assert split.own == 0.9 and split.same_traffic
    assert list(split.threads) == ["gloo_tcp_loop", "pt_gloo_runloop"]  # busiest first
    assert abs(split.threads["gloo_tcp_loop"] - 1.2) < 1e-12
    assert backend_bound(split)
    why = explain(split)
    assert "0.90x" in why and "26 calls, 1.0 KiB a step" in why and "gloo_tcp_loop 1.20x" in why


def test_more_own_work_or_other_collectives_is_not_excused():
    heavier = cpu_split([_row(12.0, {})], [_row(10.0, {})])
    assert not backend_bound(heavier) and "does more work (1.20x" in explain(heavier)
    other = cpu_split([_row(9.0, {}, calls=30)], [_row(10.0, {})])
    assert not backend_bound(other) and not other.same_traffic
    assert "ours issues more collectives (ours 30 calls" in explain(other)
    bigger = cpu_split([_row(9.0, {}, wire=2048.0)], [_row(10.0, {})])
    assert not backend_bound(bigger)
    fewer = cpu_split([_row(9.0, {}, calls=18, wire=1000.0)], [_row(10.0, {})])
    assert backend_bound(fewer) and "no more collectives (ours 18 calls" in explain(fewer)
    unmeasured = cpu_split([_row(None, {})], [_row(10.0, {})])
    assert explain(unmeasured) == "" and not backend_bound(unmeasured)


def test_goals_count_the_measured_reasons_apart():
    def r(ratio, backend):
        return PairResult("p", "baseline", 1.0, 1.0, ratio, 0.9, 1.2, 5, True, "c",
                          why="measured: x" if backend else "", backend=backend)
    text = goals([r(1.1, True), r(1.1, False), r(0.9, True)])
    assert "1 baseline pair(s) above 1.00x without a reason, 1 above with a measured one" \
        in text
    assert text.count("-- measured: x") == 1
