"""The device presets: one :class:`~.profile.Profile` per GPU generation, written from the
vendors' datasheets and published micro-benchmarks (``calibrated=False``), and
:func:`load_profile`, which finds a preset, a profile ``parbench calibrate`` saved, or a JSON
file.

Each preset's ``source`` names where every figure comes from. Nothing is fitted to a training
run: the achievable matmul rates are the best a public brute-force GEMM search reached on
the device (:data:`MAMF_SOURCE`), the memory bandwidth is the one a published kernel
reached where there is one (:data:`HBM_ACHIEVED`), the optimizer's mixed-precision passes
are counted from Megatron-LM's optimizer (:data:`MIXED_OPTIMIZER_BYTES`), the rest are
datasheet figures, and the latencies are stated assumptions (:data:`LATENCY_NOTE`).
"""
from __future__ import annotations

from pathlib import Path

from ..config import ConfigError
from .profile import Link, Profile, profile_dir

A100_SRC = ("NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4: BF16 Tensor Core 312 TFLOPS "
            "dense (624 with sparsity), FP32 19.5 TFLOPS, TF32 156 TFLOPS, 108 SMs; 80GB: "
            "HBM2e 2,039 GB/s; 40GB: HBM2 1,555 GB/s; NVLink 600 GB/s (both directions: "
            "300 GB/s each way); inter-node: DGX A100, 8 x 200 Gb/s HDR InfiniBand (25 GB/s "
            "per GPU each way)")
H100_SRC = ("NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM 80GB: BF16 Tensor Core "
            "989 TFLOPS dense (1,979 with sparsity), FP32 67 TFLOPS, TF32 494.5 TFLOPS "
            "dense, 132 SMs, HBM3 3.35 TB/s, 80GB, NVLink 900 GB/s (450 GB/s each way); "
            "inter-node: DGX H100, 8 x 400 Gb/s NDR InfiniBand (50 GB/s per GPU each way)")
H200_SRC = ("NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM 141GB: BF16 Tensor Core "
            "989 TFLOPS dense (1,979 with sparsity), FP32 67 TFLOPS, 132 SMs (the H100's "
            "die), HBM3e 4.8 TB/s, 141GB, NVLink 900 GB/s (450 GB/s each way); inter-node "
            "as DGX H100 (8 x 400 Gb/s NDR, 50 GB/s per GPU each way)")
B200_SRC = ("NVIDIA HGX B200 datasheet (2024), B200 at 1,000 W: BF16 Tensor Core 2,250 "
            "TFLOPS dense (4,500 with sparsity), FP32 80 TFLOPS, 148 SMs, HBM3e 8 TB/s, "
            "180GB usable, NVLink 5 1.8 TB/s (900 GB/s each way); inter-node: DGX B200, "
            "8 x 400 Gb/s ConnectX-7 (50 GB/s per GPU each way)")
#: the achievable matmul rates (BF16, TFLOP/s): Bekman, "Machine Learning Engineering Open
#: Book", chapter "Accelerators", table "Maximum Achievable Matmul FLOPS" (mamf-finder, the
#: best of a brute-force search over GEMM shapes; torch 2.6-2.7): A100 SXM 271.2 (86.9% of
#: 312), H100 SXM 794.5 (80.3% of 989; "H200 is the same"), B200 SXM 1,745.0 (77.6% of 2,250)
MAMF_SOURCE = ("achievable BF16 matmul: Bekman, ML Engineering Open Book, 'Maximum Achievable "
               "Matmul FLOPS' (mamf-finder): A100 SXM 271.2, H100 SXM 794.5 (H200 the same), "
               "B200 SXM 1745.0 TFLOP/s")
#: NVLink's application-level bandwidth is about 80% of its peak (the packets' overhead): NCCL's
#: maintainer in NVIDIA/nccl#1054 (2023), and NCCL's topology model takes 20 of an A100
#: link's 25 GB/s; applied to every NVLink preset
NVLINK_EFFICIENCY = 0.8
NVLINK_NOTE = ("NVLink priced at 80% of its peak, the application-level bandwidth NCCL's "
               "maintainer states (NVIDIA/nccl#1054)")
#: the memory bandwidth a kernel reaches, where a published measurement exists: on an A100
#: SXM4 80GB a read kernel reached 1.80 TB/s, 88% of the datasheet's 2,039 GB/s, confirmed by
#: Nsight Compute; the same thread cites a GTC talk in which no kernel passed about 90%
#: (NVIDIA developer forum, "Trouble to reach peak bandwidth of A100", thread 339083). The
#: other presets keep the datasheet figure: no measurement of theirs is cited here
HBM_ACHIEVED = {"a100-80gb": 1.80e12}
HBM_NOTE = ("HBM priced at the bandwidth a kernel reached where one was published (A100 SXM4 "
            "80GB: 1.80 TB/s, 88% of the datasheet, NVIDIA developer forum thread 339083, "
            "Nsight Compute); else at the datasheet figure")
#: the mixed-precision optimizer step's extra passes over every element of the shard, beyond
#: AdamW's own (``bytes_per_element``), as Megatron-LM's Float16OptimizerWithFloat16Params
#: steps (megatron/optimizer/optimizer.py; Narayanan et al. 2021, Sec. 5 trains in fp16
#: with fp32 master weights): the 16-bit gradient read and its fp32 main gradient written
#: (2 + 4 bytes), the gradient norm for clipping read (4) and the fp32 master weight read
#: and written back as the 16-bit model weight (4 + 2): 16 bytes; fp16 adds the loss
#: scaler's unscale-and-check of the main gradient (read 4, write 4): 24
MIXED_OPTIMIZER_BYTES = {"bf16": 16.0, "fp16": 24.0}
#: the A100 SXM4 80GB with the software of 2021-22 (CUDA 11), the generation the published
#: Megatron-LM runs used (PTD-P: NGC PyTorch 20.12, CUDA 11.1; Korthikanti et al. 2022):
#: Mu Li, "Transformers Benchmarks" (github.com/mli/transformers-benchmarks, 2022),
#: micro_bench.ipynb on the NGC PyTorch 22.07 container (CUDA 11.7), its summary table:
#: "Matrix Multiplication FP32 / FP16: 116 / 230" TFLOP/s (square fp16 matmuls up to
#: n = 8192, each timed for at least 3 s) and "Vector Multiplication 0.202" TFLOP/s for
#: ``a * 1.2`` on fp32 vectors, one FLOP per 4 bytes read and 4 written: 1.616 TB/s, an
#: element-wise kernel's bandwidth (a read and a write, as the norms, activations and
#: residuals are priced), 79% of the datasheet's 2,039 GB/s
CUDA11_A100 = {"matmul_fp16": 230e12, "elementwise_bytes_per_s": 8 * 0.202e12}
CUDA11_SOURCE = ("A100 SXM4 80GB with CUDA 11 software: Mu Li, 'Transformers Benchmarks' "
                 "(github.com/mli/transformers-benchmarks, micro_bench.ipynb, NGC PyTorch "
                 "22.07, CUDA 11.7): FP16 matmul 230 TFLOP/s, element-wise a * 1.2 on fp32 "
                 "vectors 0.202 TFLOP/s = 1.616 TB/s read and written")
#: the latency terms of the presets: NCCL's own tuning model (NVIDIA/nccl,
#: src/graph/tuning.cc, ncclTopoTuneModel, in its version with the Tree, Ring and CollNet
#: algorithms; later versions keep the NVLink ring figures) prices a ring
#: collective with the Simple protocol (large messages) at baseLat 8.4 us plus, per step,
#: hwLat 3.4 us over NVLink and 9.6 us over the network; a kernel launch is hidden behind the
#: queue (op overhead 0)
NCCL_RING_SIMPLE_US = {"base": 8.4, "nvlink": 3.4, "net": 9.6}
LATENCY_NOTE = ("latencies from NCCL's tuning model (src/graph/tuning.cc, ring, Simple "
                "protocol): 8.4 us per collective plus 3.4 us per ring step over NVLink, "
                "9.6 us between nodes; kernel launch hidden behind the queue (op overhead 0)")


def _gpu(name: str, desc: str, src: str, peak: tuple[float, float], mamf: float, sms: int,
         hbm: float, mem: float, nvlink_each_way: float, ib_each_way: float) -> Profile:
    bf16, fp32 = peak
    return Profile(
        name=name, device="cuda", description=desc, calibrated=False,
        source="; ".join((src, MAMF_SOURCE, NVLINK_NOTE, HBM_NOTE, LATENCY_NOTE)),
        memory_bytes=mem,
        matmul_flops={"bf16": bf16, "fp16": bf16, "fp32": fp32},
        matmul_achievable={"bf16": mamf, "fp16": mamf}, sm_count=sms,
        mem_bandwidth=HBM_ACHIEVED.get(name, hbm), op_overhead_s=0.0, bwd_op_overhead_s=0.0,
        backward_call_s=0.0,
        optimizer={"per_tensor_s": 0.0, "bytes_per_element": 32.0,
                   **{f"mixed_bytes_{dt}": b for dt, b in MIXED_OPTIMIZER_BYTES.items()}},
        ranks_per_node=8,
        links={"intra": Link(NVLINK_EFFICIENCY * nvlink_each_way,
                             NCCL_RING_SIMPLE_US["nvlink"] * 1e-6,
                             "NVLink, per GPU each way, 80% of the peak",
                             NCCL_RING_SIMPLE_US["base"] * 1e-6),
               "inter": Link(ib_each_way, NCCL_RING_SIMPLE_US["net"] * 1e-6,
                             "InfiniBand, per GPU each way",
                             NCCL_RING_SIMPLE_US["base"] * 1e-6)},
        overlap=1.0)


PRESETS: dict[str, Profile] = {
    "a100-80gb": _gpu("a100-80gb", "NVIDIA A100 SXM4 80GB, DGX A100 node (8 GPUs)",
                      A100_SRC, (312e12, 19.5e12), 271.2e12, 108, 2.039e12, 80e9, 300e9,
                      25e9),
    "a100-40gb": _gpu("a100-40gb", "NVIDIA A100 SXM4 40GB, DGX A100 node (8 GPUs)",
                      A100_SRC, (312e12, 19.5e12), 271.2e12, 108, 1.555e12, 40e9, 300e9,
                      25e9),
    "h100-80gb": _gpu("h100-80gb", "NVIDIA H100 SXM5 80GB, DGX H100 node (8 GPUs)",
                      H100_SRC, (989e12, 67e12), 794.5e12, 132, 3.35e12, 80e9, 450e9, 50e9),
    "h200-141gb": _gpu("h200-141gb", "NVIDIA H200 SXM 141GB, HGX H200 node (8 GPUs)",
                       H200_SRC, (989e12, 67e12), 794.5e12, 132, 4.8e12, 141e9, 450e9,
                       50e9),
    "b200-180gb": _gpu("b200-180gb", "NVIDIA B200 (HGX, 1,000 W) 180GB, DGX B200 node "
                       "(8 GPUs)", B200_SRC, (2250e12, 80e12), 1745.0e12, 148, 8.0e12, 180e9,
                       900e9, 50e9),
}


def _a100_cuda11() -> Profile:
    """The ``a100-80gb`` preset with the GEMM and element-wise rates that CUDA 11 software
    reached on the device (:data:`CUDA11_A100`), in place of today's best GEMM search and
    read kernel: the profile to price runs published in 2021-22 with."""
    p = _gpu("a100-80gb-cuda11", "NVIDIA A100 SXM4 80GB, DGX A100 node (8 GPUs), CUDA 11 "
             "software (2021-22)", A100_SRC, (312e12, 19.5e12),
             CUDA11_A100["matmul_fp16"], 108, 2.039e12, 80e9, 300e9, 25e9)
    p.mem_bandwidth = CUDA11_A100["elementwise_bytes_per_s"]
    p.source = "; ".join((A100_SRC, CUDA11_SOURCE, NVLINK_NOTE, LATENCY_NOTE))
    return p


PRESETS["a100-80gb-cuda11"] = _a100_cuda11()
ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb",
           "b200": "b200-180gb", "a100-sxm": "a100-80gb", "h100-sxm": "h100-80gb",
           "h200-sxm": "h200-141gb", "cpu": "cpu-local"}


def preset_names() -> list[str]:
    return list(PRESETS)


def load_profile(name_or_path: str) -> Profile:
    """A profile by preset name (:data:`PRESETS`), by the name
    of a profile ``parbench calibrate`` saved (``cpu-local`` by default, in
    :func:`profile_dir`), or from a JSON path. Raises ``ConfigError`` naming what exists."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in PRESETS:
        return Profile.from_dict(PRESETS[key].to_dict())
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ConfigError(f"device={name_or_path!r}: no such profile file")
        try:
            return Profile.load(path)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"device={name_or_path!r} is not a profile: {e}") from None
    saved = profile_dir() / f"{key}.json"
    if saved.exists():
        return Profile.load(saved)
    have = sorted(p.stem for p in profile_dir().glob("*.json")) if profile_dir().exists() \
        else []
    hint = " (run `parbench calibrate` to write cpu-local)" if key == "cpu-local" else ""
    raise ConfigError(f"device={name_or_path!r} is not a preset ({', '.join(PRESETS)}), a "
                      f"calibrated profile ({', '.join(have) or 'none saved in ' + str(profile_dir())}) "
                      f"or a JSON file{hint}")
