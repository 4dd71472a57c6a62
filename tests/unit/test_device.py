"""parbench.device: every branch on CPU, the CUDA ones driven by a fake ``torch.cuda`` (events,
allocator statistics, device count), and the ledger recording collectives issued from threads
other than the one that entered it (on CUDA autograd runs backward on a device thread)."""
from __future__ import annotations

import threading

import pytest
import torch

from parbench.device import (CudaPeak, DeviceError, StepTimer, backend_for, bind_rank,
                             flash_attention, gpu_slug, kind, local_device, require,
                             synchronize)
from parbench.memory import PeakMemory


class FakeEvent:
    """A CUDA event whose ``record`` reads the fake device's clock (milliseconds)."""

    def __init__(self, cuda, enable_timing=False):
        assert enable_timing
        self.cuda, self.at, self.synced = cuda, None, False

    def record(self):
        self.at = self.cuda.clock_ms

    def synchronize(self):
        self.synced = True
        self.cuda.calls.append("event.synchronize")

    def elapsed_time(self, end):
        return end.at - self.at


class FakeCuda:
    """The parts of ``torch.cuda`` parbench.device uses."""

    def __init__(self, count=1, available=True, allocated=0, peak=0):
        self.count, self.available = count, available
        self.allocated, self.peak = allocated, peak
        self.clock_ms = 0.0
        self.calls: list[str] = []
        self.current = None

    def Event(self, enable_timing=False):  # noqa: N802 (torch's name)
        return FakeEvent(self, enable_timing)

    def is_available(self):
        return self.available

    def device_count(self):
        return self.count

    def set_device(self, i):
        self.current = i
        self.calls.append(f"set_device({i})")

    def synchronize(self):
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self):
        self.calls.append("reset_peak_memory_stats")

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak


# ---- device strings and backends ------------------------------------------------------------

@pytest.mark.parametrize("device, expected", [("cpu", "cpu"), ("cuda", "cuda"),
                                              ("cuda:3", "cuda"),
                                              (torch.device("cpu"), "cpu")])
def test_kind(device, expected):
    assert kind(device) == expected


def test_kind_refuses_other_devices():
    with pytest.raises(DeviceError, match="device='tpu' must be cpu or cuda"):
        kind("tpu")


def test_backend_from_the_device_string_and_the_override():
    assert backend_for("cpu", env={}) == "gloo"
    assert backend_for("cuda:0", env={}) == "nccl"
    assert backend_for("cuda", env={"PARBENCH_BACKEND": "gloo"}) == "gloo"
    with pytest.raises(DeviceError, match="needs device=cuda"):
        backend_for("cpu", env={"PARBENCH_BACKEND": "nccl"})
    with pytest.raises(DeviceError, match="PARBENCH_BACKEND='mpi' must be one of gloo, nccl"):
        backend_for("cuda", env={"PARBENCH_BACKEND": "mpi"})


def test_bind_rank_on_cpu_touches_no_gpu():
    fake = FakeCuda(count=0, available=False)
    assert bind_rank("cpu", 3, env={}, cuda=fake) == ("cpu", "gloo")
    assert fake.calls == []


def test_bind_rank_puts_each_nccl_rank_on_its_local_gpu():
    fake = FakeCuda(count=4)
    assert bind_rank("cuda", 5, env={"LOCAL_RANK": "2"}, cuda=fake) == ("cuda:2", "nccl")
    assert fake.current == 2
    assert bind_rank("cuda", 1, env={}, cuda=fake) == ("cuda:1", "nccl")  # no LOCAL_RANK


def test_nccl_refuses_two_ranks_on_one_gpu_and_gloo_shares_it():
    fake = FakeCuda(count=1)
    with pytest.raises(DeviceError, match="LOCAL_RANK=1 but 1 CUDA device.*NCCL"):
        local_device(1, "nccl", env={"LOCAL_RANK": "1"}, cuda=fake)
    env = {"LOCAL_RANK": "1", "PARBENCH_BACKEND": "gloo"}
    assert bind_rank("cuda", 1, env=env, cuda=fake) == ("cuda:0", "gloo")
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        local_device(0, "nccl", env={}, cuda=FakeCuda(count=0))


def test_require_says_in_one_line_when_cuda_is_missing():
    with pytest.raises(DeviceError) as e:
        require("cuda", cuda=FakeCuda(available=False), env={})
    assert "device='cuda': no CUDA device on this machine" in str(e.value)
    assert "\n" not in str(e.value)
    require("cpu", 8, env={})  # always here


def test_require_counts_gpus_for_nccl_worlds():
    fake = FakeCuda(count=1)
    require("cuda", 1, env={}, cuda=fake)
    with pytest.raises(DeviceError, match="world_size=2 on device='cuda' needs 2 GPUs"):
        require("cuda", 2, env={}, cuda=fake)
    require("cuda", 2, env={"PARBENCH_BACKEND": "gloo"}, cuda=fake)
    require("cuda", 16, env={"RANK": "0"}, cuda=fake)  # torchrun places its own ranks


def test_this_machine_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="torch.cuda.is_available\\(\\) is False"):
        require("cuda")


# ---- timing ---------------------------------------------------------------------------------

def test_step_timer_on_cpu_reads_the_host_clock():
    ticks = iter([10.0, 10.25])
    timer = StepTimer("cpu", clock=lambda: next(ticks))
    assert timer.start().stop() == pytest.approx(0.25)
    real = StepTimer("cpu").start()
    assert real.stop() >= 0.0
    with pytest.raises(RuntimeError, match="before start"):
        StepTimer("cpu").stop()


def test_step_timer_on_cuda_is_the_events_elapsed_time_after_a_sync():
    fake = FakeCuda()
    timer = StepTimer("cuda:0", cuda=fake, clock=lambda: pytest.fail("host clock read"))
    fake.clock_ms = 100.0
    timer.start()
    fake.clock_ms = 137.5  # the device's work queued meanwhile ends here
    assert timer.stop() == pytest.approx(0.0375)
    assert fake.calls == ["event.synchronize"]  # the end event waited for, not the host
    with pytest.raises(RuntimeError, match="before start"):
        StepTimer("cuda", cuda=fake).stop()


def test_synchronize_waits_on_cuda_only():
    fake = FakeCuda()
    synchronize("cpu", cuda=fake)
    synchronize("cuda:1", cuda=fake)
    assert fake.calls == ["synchronize"]


def test_calibration_samples_time_k_calls():
    from parbench.calibration.timing import sample_seconds
    calls = []
    secs = sample_seconds(lambda: calls.append(1), 7, "cpu")
    assert len(calls) == 7 and secs >= 0.0


# ---- peak memory ----------------------------------------------------------------------------

def test_cuda_peak_is_the_allocator_peak_over_the_entry_plus_the_baseline():
    fake = FakeCuda(allocated=1000, peak=5000)
    with PeakMemory("cuda", 300, cuda=fake) as pm:
        pass
    assert pm.peak == 300 + 5000 - 1000
    assert fake.calls == ["synchronize", "reset_peak_memory_stats", "synchronize"]


def test_cuda_peak_never_below_the_baseline():
    fake = FakeCuda(allocated=5000, peak=4000)  # frees only: the peak stays the entry's
    cp = CudaPeak(700, cuda=fake)
    cp.enter()
    assert cp.exit() == 700 and cp.allocator_peak == 4000


def test_cpu_peak_still_tracks_live_storages():
    with PeakMemory("cpu", 100) as pm:
        x = torch.ones(1000)
        del x
    assert pm.peak >= 100 + 4000


# ---- names and kernels ----------------------------------------------------------------------

@pytest.mark.parametrize("name, total, slug", [
    ("NVIDIA H200", 150.1e9, "h200-141gb"),
    ("NVIDIA H100 80GB HBM3", 85.0e9, "h100-80gb"),
    ("NVIDIA H100 NVL", 100 * 2 ** 30, "h100-94gb"),
    ("NVIDIA A100-SXM4-40GB", 42.4e9, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 85.1e9, "a100-80gb"),
    ("NVIDIA L4", 22 * 2 ** 30, "nvidia-l4-22gb"),
])
def test_gpu_slug(name, total, slug):
    assert gpu_slug(name, total) == slug


def test_flash_attention_probe_answers_on_cpu():
    ok, why = flash_attention("cpu", torch.float32, 2, 16, 8)
    assert isinstance(ok, bool) and isinstance(why, str)
    assert ok or why


# ---- the ledger from other threads ----------------------------------------------------------

def _collectives_from_threads(ctx):
    """On every rank: an all-reduce from a plain thread, and a custom autograd Function whose
    backward all-reduces, its backward run from another thread (as CUDA's device threads run
    it); both inside one Ledger entered on the main thread."""
    import torch.distributed as dist

    from parbench.comm import Ledger

    class AllReduceGrad(torch.autograd.Function):
        @staticmethod
        def forward(_ctx, x):
            return x.clone()

        @staticmethod
        def backward(_ctx, g):
            g = g.contiguous()
            dist.all_reduce(g)
            return g

    x = torch.ones(8, requires_grad=True)
    with Ledger() as led:
        t = threading.Thread(target=lambda: dist.all_reduce(torch.ones(4)), name="plain")
        t.start()
        t.join()
        loss = AllReduceGrad.apply(x).sum()
        b = threading.Thread(target=loss.backward, name="backward")
        b.start()
        b.join()
    return [(r.op, r.thread, r.message_bytes, r.wire_bytes) for r in led.records], \
        float(x.grad[0])


def test_the_ledger_records_collectives_from_other_threads(pools):
    results = pools(2).run(_collectives_from_threads)
    for records, grad in results:
        assert grad == 2.0  # the backward's all-reduce ran (two ranks' ones summed)
        assert ("all_reduce", "plain", 16, 16.0) in records  # 2 (n-1)/n x 16 B
        assert ("all_reduce", "backward", 32, 32.0) in records
