"""One rank's side: its context (rank, world, device, backend, progress), how it joins the
process group (gloo on CPU with one thread per rank, NCCL on CUDA with one device per rank),
and the heartbeat of local work that reports no steps. ``parbench.launch`` starts the ranks
(a local pool) and watches them; under ``torchrun`` or Slurm a process joins as one rank with
``init_from_env``."""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass, field


#: seconds between the heartbeats of local work (``WorkerContext.working``): well under the
#: hang detector's default 60 s and the few seconds tests set
HEARTBEAT_S = 1.0


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    device: str  # "cpu" or "cuda:N"
    backend: str
    #: ``progress(text)``: this rank is alive and moving (a step began, a step ended, ...)
    progress: object = field(default=lambda text: None, repr=False)
    #: ``in_collective()``: this rank waits in a collective now (the ledger's status sink)
    in_collective: object = field(default=lambda: False, repr=False)

    @contextlib.contextmanager
    def working(self, text: str, every_s: float = HEARTBEAT_S):
        """Within: local work that reports no steps (the golden run, the final check's golden
        continuation) counts as progress: ``progress(text ...)`` every ``every_s`` seconds
        from a thread, skipped while the rank waits in a collective, so a rank stuck in one
        is still a hang (issue 20, sec. 8: a 4-rank BPipe case under load tripped the hang
        detector while its ranks trained their golden runs)."""
        stop = threading.Event()
        t0 = time.time()

        def beat():
            while not stop.wait(every_s):
                if not self.in_collective():
                    self.progress(f"{text} ({time.time() - t0:.0f} s)")

        self.progress(text)
        thread = threading.Thread(target=beat, name="parbench-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and \
        "PARBENCH_POOL_WORKER" not in os.environ


def _setup_env(threads: int, device: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    if device == "cpu":  # DeepSpeed would otherwise look for an accelerator
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def init_process_group(rank: int, world_size: int, device: str, timeout_s: float,
                       threads: int = 1) -> WorkerContext:
    """Initialise torch.distributed for this rank (env:// rendezvous) and the ledger hooks."""
    _setup_env(threads, device)
    # torch (and comm, which wraps torch.distributed) only now: the thread settings above must
    # be in the environment before torch is first imported in this process
    import torch
    import torch.distributed as dist

    from . import comm

    from .device import bind_rank

    torch.set_num_threads(threads)
    comm.install()
    # cuda: NCCL and this rank's GPU (LOCAL_RANK) made current; cpu: gloo (parbench.device)
    dev, backend = bind_rank(device, rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return WorkerContext(rank, world_size, dev, backend)


def init_from_env(device: str = "cpu", timeout_s: float = 600.0) -> WorkerContext:
    """Join a torchrun / Slurm job as one rank."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    return init_process_group(rank, world, device, timeout_s)
