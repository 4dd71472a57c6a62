"""The verdict: what each rank checks after a step (``checks``), the ranks merged
(``merge``), and the case's verdict with its bytes and model states against the closed forms
(``verdict``). ``parbench.verdict.compare`` is the tensor-wise rule every check uses."""
from .checks import (UPDATE_ATOL_LR, UPDATE_RTOL, RankChecker, StepwiseGolden, UpdateCheck,
                     check_initial, check_step, compare, detectable_wd_error,
                     golden_detectable_wd_error)
from .merge import Merged, merge_ranks
from .verdict import (exact_every_step, figures_equal, op_tallies, states_of, traffic_of,
                      verdict_of)

__all__ = ["Merged", "RankChecker", "StepwiseGolden", "UPDATE_ATOL_LR", "UPDATE_RTOL",
           "UpdateCheck", "check_initial", "check_step", "compare", "detectable_wd_error",
           "exact_every_step", "figures_equal", "golden_detectable_wd_error", "merge_ranks",
           "op_tallies", "states_of", "traffic_of", "verdict_of"]
