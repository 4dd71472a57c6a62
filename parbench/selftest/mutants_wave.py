"""Realistic bugs in the wave and memory-controlled V schedules (Hanayo, V-Half, V-Min).

They run on ``FAMILY_CASES["pipeline"]`` (pp=2, m=4) with an 8-layer model, so that
Hanayo holds 2 waves (vpp=4, 8 stages) and the V shapes 4 stages (vpp=2):

* a wave whose up-going chunks are placed like the interleaved loop (every turn crosses
  ranks; numerically right, caught by the p2p bytes against the wave's closed form);
* a rank whose two chunks meeting at a turn are built in each other's place (caught by the
  golden run: the layers run out of order);
* a V-Half / V-Min cool-down that drops the last W of a chunk (caught by the golden
  gradients).

A W filler that puts a W before its B is not here: that W has no output gradient to work
from, so no rank can run it and there are no numbers for a check to judge; the schedule
validator refuses it before anything spawns (tests/unit/test_selftest_catalogue.py).
"""
from __future__ import annotations

from impls.pipeline import SCHEMES
from impls.pipeline.executor import Executor
from impls.pipeline.scheme import schedule_for
from parbench.schedules import validate
from parbench.schedules.actions import Schedule, looped_placement
from parbench.schedules.wave import hanayo_order

from .catalogue import mutant

WAVE = {"model": "tiny-8l", "vpp": "4"}
V = {"model": "tiny-8l", "vpp": "2"}


# ---- Hanayo ----------------------------------------------------------------------------------

@mutant("hanayo-turn-crosses-ranks", base="pipeline.hanayo", overrides=WAVE,
        bug="the up-going chunks are placed as in the interleaved loop (stage c*p + r), so "
            "each turn of the wave is sent to the next rank instead of staying local")
class HanayoTurnCrossesRanks(SCHEMES["hanayo"]):
    @classmethod
    def case_schedule(cls, case):
        right = schedule_for(case, "hanayo")
        p, m, v = right.p, right.m, right.v
        placement = looped_placement(p, v)
        return validate(Schedule(
            name="hanayo", p=p, m=m, v=v, num_stages=p * v, placement=placement,
            mb_pipe=[0] * m, actions=hanayo_order(p, m, v, placement, cap=v * p),
            split_backward=False))


class _SwappedTurn:
    """Mixin: on the rank holding the first turn back up (rank 0 after the first wave, or
    the V's middle rank), the two chunks that meet at the turn swap their modules."""

    def __init__(self, ctx):
        super().__init__(ctx)
        held = [key for key in sorted(self.slots) if 0 < key[1] < self.schedule.num_stages - 1]
        for first, second in zip(held, held[1:]):
            if second[1] == first[1] + 1:  # a local hand-off: the turn
                self.slots[first], self.slots[second] = self.slots[second], self.slots[first]
                break


@mutant("hanayo-turn-chunks-swapped", base="pipeline.hanayo", overrides=WAVE,
        bug="the two chunks meeting at a turn of the wave are built in each other's place "
            "(chunk index mapped to the wrong stage on the way back up)")
class HanayoTurnChunksSwapped(_SwappedTurn, SCHEMES["hanayo"]):
    pass


# ---- V-Half / V-Min --------------------------------------------------------------------------

class _SkipLastW(Executor):
    """The cool-down drops the W of the last micro-batch on the up-going chunk (stage >= p):
    its graph is freed without the weight gradients."""

    def _backward_weight(self, slot, a) -> None:
        if a.mb == self.m - 1 and a.stage >= self.schedule.p:
            self.saved.pop((a.mb, a.stage, a.pipe))
            return
        super()._backward_weight(slot, a)


@mutant("vhalf-skip-last-w", base="pipeline.vhalf", overrides=V,
        bug="the last micro-batch's W of the up-going chunk is dropped in the cool-down")
class VHalfSkipLastW(SCHEMES["vhalf"]):
    executor_class = _SkipLastW


@mutant("vmin-skip-last-w", base="pipeline.vmin", overrides=V,
        bug="the last micro-batch's W of the up-going chunk is dropped in the cool-down")
class VMinSkipLastW(SCHEMES["vmin"]):
    executor_class = _SkipLastW


@mutant("vmin-chunks-swapped", base="pipeline.vmin", overrides=V,
        bug="the middle rank builds its two V chunks in each other's place")
class VMinChunksSwapped(_SwappedTurn, SCHEMES["vmin"]):
    pass
