"""Device profiles, calibration and the time model (``parbench calibrate``, ``estimate
device=``, ``plan``).

The API the planner builds on::

    load_profile(name_or_path) -> Profile      # a preset ("a100-80gb", "h100-80gb",
                                               # "h200-141gb"), a calibrated profile by name
                                               # ("cpu-local"), or a JSON path
    Layout(tp=1, cp=1, ep=1, dp=1, pp=1, vpp=1, sp=False, schedule="1f1b", zero_stage=0,
           recompute="none", micro_batch_size=1, num_microbatches=1, dtype="bf16", ...)
    predict_step(shape, layout, profile) -> StepTime   # step_s, tokens_per_s, mfu, compute_s,
        # recompute_s, bubble_s, exposed_comm_s, memory_per_rank_bytes, device_memory_bytes,
        # fits, heaviest_axis, notes (+ breakdown)

``profile.py`` holds the :class:`Profile` and the presets (with their sources);
``calibrate.py`` drives the measurements (``calibration_plan.py`` what is measured,
``timing.py`` how, ``tasks.py`` what each rank runs); ``model.py`` prices a step from
``layout.py``'s inputs with ``costs.py`` (layers), ``ends.py`` (embedding, head),
``pipeline_time.py`` (the schedule) and ``dp_memory.py`` (gradient sync, memory).
"""
from .model import Layout, StepTime, memory_per_rank, predict_step
from .profile import PRESETS, Fit, Link, Profile, load_profile, preset_names, profile_dir

__all__ = ["Fit", "Layout", "Link", "PRESETS", "Profile", "StepTime", "load_profile",
           "memory_per_rank", "predict_step", "preset_names", "profile_dir"]
