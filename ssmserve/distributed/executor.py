"""Running the model on one rank or on several: the engine talks to an executor.

`LocalExecutor` wraps the engine process's own ModelRunner (tensor_parallel_size 1).
`TensorParallelExecutor` is rank 0 of a tensor-parallel group: it starts the other
ranks as worker processes itself (or joins ranks started by `torchrun`), and each step
broadcasts what they need, the packed step tensor (`StepInputs.pack`), over a gloo
group; every rank then runs its shard of the same forward. Rank 0 keeps the scheduler,
sampler and detokenizer; workers run the model and nothing else.

A worker that dies or fails a collective makes the next (or the current) step raise
`WorkerFailedError`; shutdown stops every worker, and a worker whose engine process
dies exits by itself.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from ssmserve.config import EngineConfig, ModelConfig
from ssmserve.distributed.parallel import TensorParallel

logger = logging.getLogger(__name__)

_STEP, _CALL, _EXIT = 1, 2, 3
# How long a collective may wait for a silent peer before it fails (a dead peer fails
# a gloo collective at once; this bounds a hung one).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or a collective failed; the engine cannot go on."""


class LocalExecutor:
    """Tensor-parallel size 1: the runner lives in this process."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.runner, method)(*args)

    def execute(self, packed: torch.Tensor) -> torch.Tensor:
        return self.runner.execute(packed)

    def shutdown(self) -> None:
        self.runner.release_caches()


def torchrun_rank() -> int | None:
    """This process's rank when started by torchrun (its RANK variable), else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a group started on one machine takes GPU r (after the given index)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_tp(rank: int, size: int) -> TensorParallel:
    cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank=rank, size=size, group=dist.group.WORLD, cpu_group=cpu_group)


def _check_shapes(model_config: ModelConfig, size: int) -> None:
    """Build rank 0's shard on the meta device: a model that cannot be split over `size`
    ranks fails here, with the layer's message, before any worker starts."""
    from ssmserve.kernels import get_ops
    from ssmserve.models.base import ModelContext
    from ssmserve.models.registry import model_class

    ctx = ModelContext(get_ops("torch", "cpu"), TensorParallel(rank=0, size=size))
    with torch.device("meta"):
        model_class(model_config.architecture)(model_config.hf_config, ctx)


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel group of `config.tensor_parallel_size` ranks."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        from ssmserve.engine.model_runner import ModelRunner

        size = config.tensor_parallel_size
        _check_shapes(model_config, size)
        self._procs: list[subprocess.Popen] = []
        self._failed: str | None = None
        self._closed = False
        if torchrun_rank() is None:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            level = logging.getLogger().getEffectiveLevel()
            for rank in range(1, size):
                args = (rank, size, init_method, config, model_config, device, dtype, level)
                self._procs.append(_spawn_worker(args))
            for proc in self._procs:
                threading.Thread(target=self._watch_worker, args=(proc,), daemon=True).start()
        else:
            init_method = "env://"
        try:
            dist.init_process_group(
                _backend(device),
                init_method=init_method,
                rank=0,
                world_size=size,
                timeout=COLLECTIVE_TIMEOUT,
            )
            self.tp = _make_tp(0, size)
            self.runner = ModelRunner(config, model_config, device, dtype, self.tp)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)
        logger.info("tensor parallel: %d ranks over %s", size, _backend(device))

    @property
    def workers(self) -> list[subprocess.Popen]:
        """The worker processes this executor started (none under torchrun)."""
        return list(self._procs)

    def _watch_worker(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closed and self._failed is None:
            self._failed = f"tensor-parallel worker (pid {proc.pid}) exited with code {code}"
            logger.error("%s; in-flight requests fail", self._failed)

    def _check(self) -> None:
        if self._closed:
            raise WorkerFailedError("the tensor-parallel group is shut down")
        if self._failed:
            raise WorkerFailedError(self._failed)

    def _command(self, cmd: int, n: int = 0) -> None:
        dist.broadcast(torch.tensor([cmd, n]), 0, group=self.tp.cpu_group)

    def call(self, method: str, *args: Any) -> Any:
        """Run runner.`method`(*args) on every rank; rank 0's result."""
        self._check()
        try:
            self._command(_CALL)
            dist.broadcast_object_list([(method, args)], 0, group=self.tp.cpu_group)
            return getattr(self.runner, method)(*args)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failure(exc) from exc

    def execute(self, packed: torch.Tensor) -> torch.Tensor:
        self._check()
        try:
            self._command(_STEP, packed.numel())
            dist.broadcast(packed, 0, group=self.tp.cpu_group)
            return self.runner.execute(packed)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: BaseException) -> WorkerFailedError:
        if isinstance(exc, WorkerFailedError):
            return exc
        self._failed = self._failed or f"a tensor-parallel collective failed: {exc}"
        return WorkerFailedError(self._failed)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            if not self._failed:
                try:
                    self._command(_EXIT)
                except (RuntimeError, dist.DistBackendError):
                    pass
            for proc in self._procs:
                _wait(proc, 10)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                _wait(proc, 5)
            if proc.stdin is not None:
                proc.stdin.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def _spawn_worker(args: tuple) -> subprocess.Popen:
    """Start one worker as `python -m ssmserve.distributed.executor`, its arguments pickled
    on stdin. A fresh interpreter (not a fork, and not multiprocessing's spawn, which
    re-imports the caller's main module) keeps CUDA and user scripts out of the worker."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssmserve.distributed.executor"], stdin=subprocess.PIPE
    )
    pickle.dump(args, proc.stdin)
    proc.stdin.flush()
    return proc


def _worker_process() -> None:
    """Entry point of a spawned worker: read the arguments, then serve rank 0. The engine
    keeps this process's stdin open; when it closes (the engine exited or died), exit."""
    rank, size, init_method, config, model_config, device, dtype, level = pickle.load(
        sys.stdin.buffer
    )
    logging.basicConfig(level=level, format=f"%(levelname)s tp{rank} %(name)s: %(message)s")

    def exit_with_parent() -> None:
        # Raw reads of fd 0: a thread blocked in sys.stdin would hold its lock at exit.
        while os.read(sys.stdin.fileno(), 1 << 16):
            pass
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    run_worker(rank, size, init_method, config, model_config, _rank_device(device, rank), dtype)


def run_worker(
    rank: int,
    size: int,
    init_method: str,
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """A worker rank: build the shard, then serve rank 0's commands until it says exit."""
    from ssmserve.engine.model_runner import ModelRunner

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        _backend(device),
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    tp = _make_tp(rank, size)
    runner = ModelRunner(config, model_config, device, dtype, tp)
    head = torch.zeros(2, dtype=torch.long)
    while True:
        dist.broadcast(head, 0, group=tp.cpu_group)
        cmd, n = head.tolist()
        if cmd == _STEP:
            packed = torch.empty(n, dtype=torch.long)
            dist.broadcast(packed, 0, group=tp.cpu_group)
            runner.execute(packed)
        elif cmd == _CALL:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, 0, group=tp.cpu_group)
            method, args = message[0]
            getattr(runner, method)(*args)
        else:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker_process()
