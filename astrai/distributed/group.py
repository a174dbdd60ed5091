"""The tensor-parallel process group: rank 0, the engine's process, and N - 1 workers.

torch.distributed carries everything: the default group (NCCL on CUDA, gloo on the CPU) sums
the row-parallel layers' partial outputs, and a gloo group of its own carries rank 0's plan of
each step to the workers. Started in one process, the group spawns its workers with
torch.multiprocessing on a free loopback port; started under torchrun (RANK and WORLD_SIZE in
the environment), every process is already there and joins by torchrun's rendezvous.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from astrai.distributed.executor import STOP_MESSAGE
from astrai.kernels.graph import launch
from astrai.kernels.native import kernel_op

log = logging.getLogger(__name__)

# A worker waits for the next step as long as the engine stays idle; a dead rank 0 ends it
# through watch_parent instead.
PLAN_TIMEOUT = timedelta(days=30)
# How long a worker may take to exit after the group is closed before it is terminated.
JOIN_SECONDS = 10.0
HEADER_SIZE = 5


@kernel_op("all_reduce_sum", mutates_args=("x",))
def all_reduce_sum(x: torch.Tensor) -> None:
    """Sum x across the default process group, in place: an astrai op, so that a step graph
    (astrai.kernels.graph) records it as the kernel call it is between two kernels."""
    dist.all_reduce(x)


class TensorParallelGroup:
    """This process's membership in the group: all-reduce, the step channel, shutdown.

    On rank 0 it owns the spawned workers (none under torchrun) and watches them: a worker
    that exits makes failure say so, and every later collective raises.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        device: torch.device,
        workers: list[BaseProcess],
        threads: int,
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.threads = threads  # torch's threads before joining, given back on close
        self.workers = workers
        self.plans = dist.new_group(backend="gloo", timeout=PLAN_TIMEOUT)
        self.reduce_seconds = 0.0  # spent in all_reduce, for the benchmarks
        self.failure: str | None = None
        self.closed = False
        if workers:
            threading.Thread(target=self._watch, name="astrai-tp-watch", daemon=True).start()

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum x across the ranks, in place; a recorded step graph replays it."""
        launch(self._timed_all_reduce, x)

    def _timed_all_reduce(self, x: torch.Tensor) -> None:
        start = time.perf_counter()
        torch.ops.astrai.all_reduce_sum(x)
        self.reduce_seconds += time.perf_counter() - start

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [rows, cols] side by side on rank 0, [rows, size * cols]; None on
        the others (a vocabulary-parallel head's logits)."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=1) if parts is not None else None

    def barrier(self) -> None:
        dist.barrier()

    def send(self, header: list[int], body: torch.Tensor | None = None) -> None:
        """Rank 0: broadcast a message, header (HEADER_SIZE ints) and an int64 body."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        dist.broadcast(torch.tensor(header, dtype=torch.long), 0, group=self.plans)
        if body is not None and body.numel():
            dist.broadcast(body, 0, group=self.plans)

    def receive_header(self) -> list[int]:
        """A worker: the header of rank 0's next message."""
        header = torch.empty(HEADER_SIZE, dtype=torch.long)
        dist.broadcast(header, 0, group=self.plans)
        return header.tolist()

    def receive_body(self, size: int) -> torch.Tensor:
        """A worker: the body of the message whose header it just received."""
        body = torch.empty(size, dtype=torch.long)
        if size:
            dist.broadcast(body, 0, group=self.plans)
        return body

    def _watch(self) -> None:
        """Rank 0: note the first worker to exit before close()."""
        ready = wait([worker.sentinel for worker in self.workers])
        if self.closed:
            return
        worker = next(w for w in self.workers if w.sentinel in ready)
        worker.join(JOIN_SECONDS)  # reaps it, for its exit code
        self.failure = (
            f"tensor-parallel worker {worker.name} exited with code {worker.exitcode}; "
            "restart the engine"
        )
        log.error("%s", self.failure)

    def close(self) -> None:
        """Leave the group; on rank 0, join the workers (terminating any that do not exit)."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0 and self.failure is None:
            try:
                self.send([STOP_MESSAGE] + [0] * (HEADER_SIZE - 1))
            except RuntimeError as error:  # a worker died since the last step
                log.warning("could not stop the tensor-parallel workers: %s", error)
        for worker in self.workers:
            worker.join(JOIN_SECONDS)
        for worker in self.workers:
            if worker.is_alive():
                log.warning("terminating tensor-parallel worker %s", worker.name)
                worker.kill()
                worker.join()
        dist.destroy_process_group()
        # Free the step channel's group now: left to the interpreter's exit (an engine kept
        # alive by a finished stream), gloo's threads could be torn down unjoined (an abort).
        self.plans = None
        torch.set_num_threads(self.threads)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    timeout: float,
    workers: list[BaseProcess] = (),
) -> TensorParallelGroup:
    """Join the group as rank; collectives wait at most timeout seconds for the others. Rank 0
    first waits for its spawned workers to start, failing at once if one exits instead."""
    wait_started(workers, timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # Each rank on this host gets its share of the cores: ranks that each start a thread
        # per core crowd one another out of them at every all-reduce.
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks_here))
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout),
    )
    return TensorParallelGroup(rank, size, device, list(workers), threads)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Each rank's device: its own GPU on CUDA (LOCAL_RANK under torchrun), else device."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))


def watch_parent() -> None:
    """End this worker when the process that spawned it is gone, so none is left behind."""
    parent = os.getppid()

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=poll, name="astrai-tp-parent", daemon=True).start()


def spawn(target, size: int, timeout: float, *args) -> tuple[list[BaseProcess], str]:
    """Start ranks 1 .. size - 1 as target(rank, init_method, timeout, *args) in spawned
    processes; (the processes, the init_method rank 0 joins by). Each process's `started`
    event is set once it is past its start-up (wait_started waits for it)."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.get_context("spawn")
    workers = []
    for rank in range(1, size):
        started = context.Event()
        worker = context.Process(
            target=_started,
            args=(started, target, rank, init_method, timeout, *args),
            name=f"astrai-tp-rank{rank}",
            daemon=True,
        )
        worker.started = started
        workers.append(worker)
    for worker in workers:
        worker.start()
    return workers, init_method


def _started(started, target, *args) -> None:
    """A spawned worker's entry: past its start-up (its imports, and the parent's main module,
    which spawn imports again), it says so, then runs target(*args)."""
    started.set()
    target(*args)


def wait_started(workers: Sequence[BaseProcess], timeout: float) -> None:
    """Wait until each spawned worker is past its start-up; one that exits first fails the
    group at once (the others are killed) instead of leaving rank 0 waiting out timeout."""
    deadline = time.monotonic() + timeout
    for worker in workers:
        while not worker.started.wait(0.05) and time.monotonic() < deadline:
            if worker.is_alive():
                continue
            for other in workers:
                other.kill()
                other.join()
            raise RuntimeError(
                f"tensor-parallel worker {worker.name} exited with code {worker.exitcode} "
                "while starting, before it joined the group (its error is above). A script "
                "that starts tensor parallelism must run it under `if __name__ == "
                '"__main__":`: each spawned worker imports the script again.'
            )
