"""Starting ranks: a persistent pool of local processes, or this process under torchrun.

Locally, ``WorkerPool(world_size)`` spawns N processes once (gloo on CPU with one thread per
rank, NCCL on CUDA with one device per rank) and runs any number of tasks on them; tests keep
one pool per world size for the whole session. A task is a picklable top-level function
called on every rank as ``fn(ctx, *args)``; each rank's return value comes back.

Failures end the task promptly, never as a silent wait:

- a rank that raises sends its traceback; the pool ends every rank at once (the others may be
  blocked in a collective) and the caller gets ``RankError`` within seconds;
- a rank that dies without a word (signal, hard exit) is noticed by polling;
- a rank that makes no progress for ``hang_timeout_s`` (progress: ``ctx.progress(...)``, which
  the harness calls at every step boundary, and a heartbeat during local work such as the
  golden run, ``ctx.working(...)``, silent while the rank waits in a collective; a rank
  waiting in a collective is excused while another rank still makes progress) is a hang:
  every rank's Python stack is dumped by
  ``faulthandler`` (all threads), each rank's current collective is read from shared memory
  (the ledger's wrappers post it), and the caller gets ``RankHang`` naming the rank that is
  not waiting in a collective.

A driver that dies leaves no rank behind: a driver ended by SIGTERM or SIGHUP closes its pools
(``parbench.terminate``), and a rank whose driver is gone however it died (SIGKILL included)
exits by itself within a moment (``_watch_driver``); the fork server and the resource tracker
then end too, as they end once no process holds their pipes.

Under ``torchrun`` or Slurm (``WORLD_SIZE`` and ``RANK`` set) ``worker.init_from_env`` joins the job
as one rank instead (hangs there end at the backend's collective timeout).
"""
from __future__ import annotations

import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback

from . import rank_start
from .worker import free_port, init_process_group


class RankError(RuntimeError):
    """A rank failed; ``rank``, its ``traceback_text`` and the failure ``kind`` are attached."""

    kind = "crashed"

    def __init__(self, rank: int, traceback_text: str):
        self.rank = rank
        self.traceback_text = traceback_text
        last = traceback_text.strip().splitlines()[-1] if traceback_text.strip() else "?"
        super().__init__(f"rank {rank} failed: {last}")


class RankHang(RankError):
    """No progress for ``hang_timeout_s``: every rank's stack and current collective."""

    kind = "hung"

    def __init__(self, rank: int, timeout_s: float, stacks: dict[int, str],
                 status: dict[int, str], progress: dict[int, str]):
        self.stacks, self.status, self.progress = stacks, status, progress
        lines = []
        for r in sorted(stacks):
            where = status.get(r) or "not in a collective"
            lines.append(f"--- rank {r}: {where}; last progress: {progress.get(r) or '-'}\n"
                         f"{stacks[r].rstrip()}")
        who = f"rank {rank}" if rank >= 0 else "no single rank (all wait in collectives)"
        text = (f"no progress for {timeout_s:g} s; hung: {who}\n" + "\n".join(lines))
        RuntimeError.__init__(self, f"hung: {who}, no progress for {timeout_s:g} s")
        self.rank = rank
        self.traceback_text = text


# ---- the shared memory a rank reports its state through ---------------------------------------

_TEXT = 240  # bytes of each status / progress text


class _Board:
    """Per rank: the collective it is in, its last progress text and time (shared memory)."""

    def __init__(self, ctx, world_size: int):
        self.status = [ctx.Array("c", _TEXT, lock=False) for _ in range(world_size)]
        self.progress = [ctx.Array("c", _TEXT, lock=False) for _ in range(world_size)]
        self.when = ctx.Array("d", world_size, lock=False)

    @staticmethod
    def write(arr, text: str) -> None:
        data = text.encode()[:_TEXT - 1]
        arr[:len(data) + 1] = data + b"\0"

    @staticmethod
    def read(arr) -> str:
        return bytes(arr[:]).split(b"\0", 1)[0].decode(errors="replace")

    def touch(self, rank: int, text: str) -> None:
        self.write(self.progress[rank], text)
        self.when[rank] = time.time()


#: a rank's exit status when its driver is gone (``_watch_driver``)
DRIVER_GONE_EXIT = 1


def _watch_driver(lifeline) -> None:
    """End this rank at once when its driver is gone, however it died.

    ``lifeline`` is the reading end of a pipe whose only writing end the driver holds (the
    pool's ``_lifeline``: ranks are forked from the fork server or spawned, so none inherits
    it) and never writes to: its end of file means the driver exited or was killed --
    SIGKILL, which no handler sees, included -- while a rank may be blocked in a collective
    whose peers wait for the same driver. A daemon thread blocks in the read, so the timed
    steps pay nothing (no per-step work, no polling); it touches no device, so it is the same
    on CUDA / NCCL. Polling the driver's pid instead would need a period, would take a
    zombie driver (killed, not yet reaped by its parent) for a live one, and could meet a
    reused pid; the fork server, the rank's parent, outlives the driver while ranks hold
    its pipe, so the parent pid says nothing either."""
    def watch():
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(DRIVER_GONE_EXIT)

    threading.Thread(target=watch, name="parbench-driver-watch", daemon=True).start()


def _worker_main(rank, world_size, port, device, timeout_s, threads, tasks, results, board,
                 stack_dir, env=None, lifeline=None):
    if lifeline is not None:  # first: a rank stuck in the rendezvous also goes with its driver
        _watch_driver(lifeline)
    rank_start.adopt(env)  # forked from the server: the parent's environment, as spawn gives
    if not os.environ.get("PARBENCH_VERBOSE"):
        # libraries print banners on stdout (DeepSpeed lists its layers); the parent's
        # progress and tables own stdout. stderr (warnings) stays; PARBENCH_VERBOSE=1 keeps all
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "PARBENCH_POOL_WORKER": "1"})
    import faulthandler
    stack_file = open(os.path.join(stack_dir, f"rank{rank}.txt"), "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        ctx = init_process_group(rank, world_size, device, timeout_s, threads)
    except BaseException:
        results.put((rank, -1, "err", traceback.format_exc()))
        return
    from . import comm  # after init_process_group set up torch (above)
    comm.set_status_sink(lambda text: _Board.write(board.status[rank], text))
    ctx.progress = lambda text: board.touch(rank, text)
    ctx.in_collective = lambda: bool(_Board.read(board.status[rank]))
    results.put((rank, -1, "ready", None))
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, kwargs = item
        board.touch(rank, "task started")
        try:
            out = fn(ctx, *args, **kwargs)
            results.put((rank, task_id, "ok", out))
        except BaseException:
            results.put((rank, task_id, "err", traceback.format_exc()))
    try:
        import torch.distributed as dist
        dist.destroy_process_group()
    except Exception:
        pass
    os._exit(0)


#: the default start-up net: 4- and 8-rank pools took more than 120 s to start on a 2-core
#: machine whose cores two other processes kept busy (issue 19's CI-under-load runs)
START_TIMEOUT_S = 300.0
#: how many ports a pool tries before a start that found its port taken is an error
PORT_TRIES = 3


class WorkerPool:
    """N local ranks started once and reused for many tasks."""

    def __init__(self, world_size: int, *, device: str = "cpu", timeout_s: float = 120.0,
                 threads: int = 1, start_timeout_s: float | None = None,
                 hang_timeout_s: float = 60.0):
        """``start_timeout_s``: how long the ranks may take to start (import torch, join the
        process group) before the pool gives up; default ``START_TIMEOUT_S`` or twice the
        collective timeout. A rank that dies while starting is reported at once, and one
        stuck in the rendezvous ends at ``timeout_s`` (the process group's own timeout), so
        this is only a net under heavy load."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.threads = threads
        self._ctx = rank_start.context()
        self._procs: list = []
        self._lifeline = None  # the writing end of the ranks' lifeline (``_watch_driver``)
        self._busy = False  # a task was queued and its results not all collected
        self._task_qs: list = []
        self._results = None
        self._next_id = 0
        self._stack_dir = tempfile.mkdtemp(prefix="parbench-stacks-")
        self._board = _Board(self._ctx, world_size)
        self._start(start_timeout_s or max(START_TIMEOUT_S, 2 * timeout_s))

    # ---- lifecycle ------------------------------------------------------------------------
    def _start(self, start_timeout_s: float) -> None:
        """Start the ranks on a fresh port; a port taken between ``free_port`` choosing it
        and rank 0 listening on it (another process's connection can take any free port)
        is chosen again, up to ``PORT_TRIES`` times -- any other start failure is raised."""
        for attempt in range(PORT_TRIES):
            try:
                return self._start_on(free_port(), start_timeout_s)
            except RankError as exc:
                if "EADDRINUSE" not in exc.traceback_text or attempt == PORT_TRIES - 1:
                    raise

    def _start_on(self, port: int, start_timeout_s: float) -> None:
        os.makedirs(self._stack_dir, exist_ok=True)  # a failed start's close removed it
        self._results = self._ctx.Queue()
        self._task_qs = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = []
        reader, self._lifeline = self._ctx.Pipe(duplex=False)
        try:
            for r in range(self.world_size):
                p = self._ctx.Process(target=_worker_main, daemon=True,
                                      args=(r, self.world_size, port, self.device,
                                            self.timeout_s, self.threads, self._task_qs[r],
                                            self._results, self._board, self._stack_dir,
                                            rank_start.environment(), reader))
                p.start()
                self._procs.append(p)
            reader.close()  # each rank has its own copy now
            self._collect(-1, start_timeout_s, hang_s=None)
        except BaseException:  # Terminated or Ctrl-C while starting: no caller to close it
            self.close(force=True)
            raise

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        """End the ranks: let them leave their loop (up to 5 s) unless ``force`` or a task
        is still running on them (they would not read the request before it ends), then kill
        what is left."""
        if not self._procs:
            return
        if not (force or self._busy):
            for q in self._task_qs:
                try:
                    q.put(None)
                except Exception:
                    pass
            deadline = time.time() + 5
            for p in self._procs:
                p.join(max(0.0, deadline - time.time()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(2)
        self._procs = []
        self._lifeline.close()
        shutil.rmtree(self._stack_dir, ignore_errors=True)  # read by _hang before it closes

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close(force=exc[0] is not None)

    # ---- tasks ----------------------------------------------------------------------------
    def run(self, fn, *args, timeout_s: float | None = None,
            hang_timeout_s: float | None = None, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the per-rank results.

        Raises ``RankError`` (and ends the pool) if any rank raises, dies, or the task runs
        past ``timeout_s``; ``RankHang`` if a rank makes no progress for ``hang_timeout_s``
        (default: the pool's).
        """
        if not self.alive:
            raise RuntimeError("the worker pool is not running (a previous task failed)")
        task_id = self._next_id
        self._next_id += 1
        now = time.time()
        for r in range(self.world_size):
            self._board.when[r] = now
            _Board.write(self._board.progress[r], "task queued")
        self._busy = True
        for q in self._task_qs:
            q.put((task_id, fn, args, kwargs))
        out = self._collect(task_id, timeout_s,
                            hang_s=self.hang_timeout_s if hang_timeout_s is None
                            else hang_timeout_s)
        self._busy = False
        return out

    def _collect(self, task_id: int, timeout_s: float | None, hang_s: float | None) -> list:
        out: list = [None] * self.world_size
        done = [False] * self.world_size
        deadline = None if timeout_s is None else time.time() + timeout_s
        while not all(done):
            try:
                rank, tid, status, payload = self._results.get(timeout=0.5)
            except queue.Empty:
                self._check(deadline, timeout_s, hang_s, done)
                continue
            if status == "err":
                self.close(force=True)
                raise RankError(rank, payload)
            if tid != task_id:
                continue
            out[rank] = payload
            done[rank] = True
        return out

    def _check(self, deadline, timeout_s, hang_s, done) -> None:
        dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
        if dead:
            r = dead[0]
            code = self._procs[r].exitcode
            self.close(force=True)
            raise RankError(r, f"rank {r} exited with code {code} without a result")
        if deadline is not None and time.time() > deadline:
            self.close(force=True)
            raise RankError(-1, f"task timed out after {timeout_s} s")
        if hang_s is not None and self._stale(hang_s, done):
            raise self._hang(hang_s, done)

    def _stale(self, hang_s: float, done: list[bool]) -> list[int]:
        """The ranks without progress for ``hang_s``. A rank that waits in a collective is
        excused while another rank still makes progress (it waits for that rank: a fast rank
        at the first step's barrier while a slow one trains its golden run); when no rank
        has progressed for ``hang_s``, or a rank is silent outside any collective, it is a
        hang."""
        now = time.time()
        running = [r for r in range(self.world_size) if not done[r]]
        latest = max((self._board.when[r] for r in running), default=now)
        someone_moves = now - latest <= hang_s
        return [r for r in running if now - self._board.when[r] > hang_s
                and not (someone_moves and _Board.read(self._board.status[r]))]

    def _hang(self, hang_s: float, done: list[bool]) -> RankHang:
        """Dump every rank's stack, read where each rank is, end the pool."""
        status = {r: _Board.read(self._board.status[r]) for r in range(self.world_size)}
        progress = {r: _Board.read(self._board.progress[r]) for r in range(self.world_size)}
        for p in self._procs:
            if p.is_alive() and hasattr(signal, "SIGUSR1"):
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)
        stacks = {}
        for r in range(self.world_size):
            path = os.path.join(self._stack_dir, f"rank{r}.txt")
            try:
                with open(path) as fh:
                    stacks[r] = fh.read() or "(no stack written)"
            except OSError:
                stacks[r] = "(no stack file)"
        self.close(force=True)
        # the rank to blame: running, not waiting in a collective, least recent progress
        free = [r for r in range(self.world_size) if not done[r] and not status[r]]
        blamed = min(free, key=lambda r: self._board.when[r]) if free else -1
        return RankHang(blamed, hang_s, stacks, status, progress)


_POOLS: dict[tuple, WorkerPool] = {}
#: the collective timeout of the process-wide pools (``RunConfig.timeout_s``'s default)
SHARED_TIMEOUT_S = 120.0


def shared_pool(world_size: int, device: str = "cpu",
                timeout_s: float = SHARED_TIMEOUT_S) -> WorkerPool:
    """A process-wide pool per (world size, device), restarted if a task killed it."""
    key = (world_size, device)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive:
        pool = WorkerPool(world_size, device=device, timeout_s=timeout_s)
        _POOLS[key] = pool
    return pool


def close_shared_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()
