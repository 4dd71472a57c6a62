"""Device profiles and the time model (``estimate device=``, ``plan``): arithmetic on a
profile; measuring one (``parbench calibrate``, which spawns ranks) is
``parbench.calibration``.

The API the planner builds on::

    load_profile(name_or_path) -> Profile      # a preset ("a100-80gb", "h100-80gb",
                                               # "h200-141gb"), a calibrated profile by name
                                               # ("cpu-local"), or a JSON path
    Training(layout=Layout(...), options=Options(...), dtype="bf16", optimizer="adamw")
    Training.of(tp=8, pp=4, sp=True, zero_stage=1, num_microbatches=16)  # by bare names
    predict_step(shape, training, profile) -> StepTime   # step_s, tokens_per_s, mfu, compute_s,
        # recompute_s, bubble_s, exposed_comm_s, memory_per_rank_bytes, device_memory_bytes,
        # fits, heaviest_axis, notes (+ breakdown)

``profile.py`` holds the :class:`Profile` (and its GEMM shape model), ``devices.py`` the
device presets with their sources;
``model.py`` prices a step of a ``Training`` (``training.py``) with ``transformer_layer.py``
(one layer; its pricing helpers in ``costs.py``), ``ends.py`` (embedding, head),
``pipeline_time.py`` (the schedule) and ``dp_memory.py`` (gradient sync, memory), and
assembles the ``StepTime`` in ``step_breakdown.py``.
"""
from .training import Training
from .model import StepTime, memory_per_rank, predict_step
from .devices import PRESETS, load_profile, preset_names
from .profile import Fit, Link, Profile, profile_dir

__all__ = ["Fit", "Training", "Link", "PRESETS", "Profile", "StepTime", "load_profile",
           "memory_per_rank", "predict_step", "preset_names", "profile_dir"]
