"""The verdict: what each rank checks after a step (``checks``), the ranks merged
(``merge``), the case's verdict with its bytes and model states against the closed forms
(``verdict``), the timed steps' ledgers (``timed``) and the final state after them
(``final``). ``parbench.verdict.compare`` is the tensor-wise rule every check uses."""
from .checks import (UPDATE_ATOL_LR, UPDATE_RTOL, RankChecker, StepwiseGolden, UpdateCheck,
                     check_initial, check_step, compare, detectable_wd_error,
                     golden_detectable_wd_error)
from .final import final_check
from .merge import Merged, merge_ranks
from .timed import TimedLedger, timed_ledger
from .verdict import (exact_every_step, figures_equal, op_tallies, states_of, traffic_of,
                      verdict_of)

__all__ = ["Merged", "RankChecker", "StepwiseGolden", "TimedLedger", "UPDATE_ATOL_LR",
           "UPDATE_RTOL", "UpdateCheck", "check_initial", "check_step", "compare",
           "detectable_wd_error", "exact_every_step", "figures_equal", "final_check",
           "golden_detectable_wd_error", "merge_ranks", "op_tallies", "states_of",
           "timed_ledger", "traffic_of", "verdict_of"]
