"""Asynchronous pipelines run continuously: the whole run as one 1F1B schedule, cut into steps.

PipeDream (Narayanan et al. 2019, Sec. 3) and PipeDream-2BW (Narayanan et al. 2021, Sec. 3)
never flush: the 1F1B order runs from the first micro-batch of the run to the last, and a
rank's backwards lag its forwards by its warm-up p-1-r all the way through. The generators
``pipedream`` and ``2bw`` (``basic``) give one iteration started from an empty pipeline --
what ``parbench schedule`` draws; here the same order spans a run of ``steps`` harness
steps of m micro-batches each (global micro-batch g = t m + i):

* ``continuous_schedule``: the run's 1F1B over steps * m micro-batches, validated like any
  schedule (so the executor cannot deadlock on it);
* ``step_bounds``: where each rank's row is cut: step t on rank r starts at its forward of
  micro-batch t m, so a step runs the forwards of its own m micro-batches (the data the
  harness hands that step; the last stage computes that step's losses) interleaved with
  the backwards lagging them, m - (p-1-r) in the first step, m in steady state and m +
  (p-1-r) in the last, which drains. The p-1-r micro-batches in flight at the end of a step
  complete in the next;
* ``steady_step``: one steady step (step 1 of a 3-step run) as a window, with the actions
  of the step before in ``done_before``, for the simulator and the measured replay;
* ``steady_closed_form``: its bubble. The papers' steady state has none; a harness step
  ends at a barrier, so every step restarts the forward chain: rank r waits r T_F for the
  step's first micro-batch, and the last backward of the step ends (p-1-r) T_F after its
  own work elsewhere, so each rank idles (p-1) T_F per step, ratio
  (p-1) T_F / ((p-1) T_F + m (T_F + T_B + T_W)) -- a forward ramp where a flushing 1F1B
  pays (p-1)(T_F + T_B + T_W) (PTD-P Sec. 2.2.1).
"""
from __future__ import annotations

from .actions import FORWARD, Action, Schedule, ScheduleError, linear_placement
from .basic import one_f_one_b_rows
from .closed_forms import ClosedForm
from .registry import SCHEDULES
from .spec import ExecutorKind
from .validate import validate

#: the schedules that run continuously (their specs' executor; their generators are
#: 1F1B-ordered)
CONTINUOUS = tuple(name for name, spec in SCHEDULES.items()
                   if spec.executor is ExecutorKind.ASYNCHRONOUS)


def _check(name: str, p: int, m: int, steps: int) -> None:
    if name not in CONTINUOUS:
        raise ScheduleError(f"schedule name={name!r} does not run continuously "
                            f"(only {', '.join(CONTINUOUS)})")
    for field, value in (("p", p), ("m", m), ("steps", steps)):
        if value < 1:
            raise ScheduleError(f"{field}={value} must be >= 1")


def continuous_schedule(name: str, p: int, m: int, steps: int) -> Schedule:
    """The whole run of ``steps`` steps as one 1F1B schedule over steps * m micro-batches."""
    _check(name, p, m, steps)
    total = steps * m
    return validate(Schedule(
        name=name, p=p, m=total, v=1, num_stages=p, placement=linear_placement(p),
        mb_pipe=[0] * total, actions=one_f_one_b_rows(p, total), split_backward=False,
        asynchronous=True, notes=f"{steps} steps of {m} micro-batches, no flush"))


def step_bounds(run: Schedule, m: int, steps: int) -> list[list[tuple[int, int]]]:
    """``bounds[t][r] = (lo, hi)``: step t of rank r is ``run.actions[r][lo:hi]``.

    Step t >= 1 starts at the rank's forward of micro-batch t m; the last step runs to the
    end of the row (the drain).
    """
    starts = []
    for r, row in enumerate(run.actions):
        (_, stage), = run.stages_of(r)
        pos = {a: i for i, a in enumerate(row)}
        cuts = [0] + [pos[Action(FORWARD, t * m, stage)] for t in range(1, steps)] + [len(row)]
        starts.append(cuts)
    return [[(starts[r][t], starts[r][t + 1]) for r in range(run.p)] for t in range(steps)]


def steady_step(name: str, p: int, m: int) -> Schedule:
    """Step 1 of a 3-step continuous run: micro-batches m .. 2m-1 forward, the backwards
    lagging them, and step 0 in ``done_before``. Measured steps are compared with it after
    shifting their micro-batches by a whole number of steps (``relabel``)."""
    run = continuous_schedule(name, p, m, 3)
    bounds = step_bounds(run, m, 3)
    rows = [run.actions[r][lo:hi] for r, (lo, hi) in enumerate(bounds[1])]
    before = frozenset(a for r, (lo, hi) in enumerate(bounds[0])
                       for a in run.actions[r][lo:hi])
    return Schedule(name=name, p=p, m=m, v=1, num_stages=p, placement=linear_placement(p),
                    mb_pipe=[0] * (3 * m), actions=rows, split_backward=False,
                    asynchronous=True, done_before=before,
                    notes="one steady step of the continuous pipeline (a window)")


def relabel(mb: int, step: int, m: int) -> int:
    """Micro-batch ``mb`` of step ``step`` as the same position in ``steady_step``."""
    return mb - (step - 1) * m


def steady_closed_form(p: int, m: int, tf: float = 1.0, tb: float = 1.0,
                       tw: float = 1.0) -> ClosedForm:
    """One steady step between barriers: idle (p-1) T_F per rank (module docstring)."""
    return ClosedForm.of(
        m=m, v=1, tf=tf, tb=tb, tw=tw, bubble_size=(p - 1) * tf,
        formula="(p-1)T_F / ((p-1)T_F + m(T_F+T_B+T_W))",
        source="Narayanan et al. 2019 Sec. 3 (no bubble in steady state) + one forward "
               "ramp per harness step", exact=True,
        conditions="uniform stage costs, p2p=0, m >= p-1, a steady step (neither the "
                   "first nor the last)",
        note="the papers' continuous pipeline has no bubble; the harness barrier between "
             "steps restarts the forward chain once per step")
