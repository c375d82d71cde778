"""Running the model on one rank or on several: the engine talks to an executor.

`LocalExecutor` wraps the engine process's own ModelRunner (one rank).
`DistributedExecutor` is rank 0 of `tensor_parallel_size x pipeline_parallel_size`
ranks. It starts the other ranks as worker processes itself (or joins ranks started by
`torchrun`). Rank r runs pipeline stage r // TP as tensor-parallel rank r % TP; rank 0
keeps the scheduler, sampler and detokenizer, workers run the model and nothing else.

Each step rank 0 sends every worker the packed step tensor (`StepInputs.pack`) over a
gloo group, point to point, so it never waits for a busy worker (under tensor
parallelism alone, input tokens still being sampled follow as a device broadcast of the
sampled ids of the step before, see `LLMEngine.step`); each stage receives the
previous stage's hidden state, runs its layers and sends the result on (NCCL between
GPUs, gloo on CPU), and the last stage's first rank sends the logits back to rank 0.
Stages handle steps in the order they were sent, so several steps (micro-batches of
different requests) can be in the pipeline at once: `depth` of them.

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ssmserve.config import EngineConfig, ModelConfig
from ssmserve.distributed.parallel import TensorParallel
from ssmserve.distributed.pipeline import stage_layers
from ssmserve.engine.collector import freeze_engine_objects
from ssmserve.layers.batch import sampled_rows_read

logger = logging.getLogger(__name__)

_STEP, _CALL, _EXIT = 1, 2, 3
# How long a collective may wait for a silent peer before it fails (a dead peer fails
# a gloo collective at once; this bounds a hung one).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


class WorkerFailedError(RuntimeError):
    """A worker died or a collective failed; the engine cannot go on."""


class Logits:
    """A step's logits: at hand, or on their way from the last pipeline stage."""

    def __init__(self, value: torch.Tensor | None, work: Any = None, check=None) -> None:
        self._value, self._work, self._check = value, work, check

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            try:
                self._work.wait()
            except (RuntimeError, dist.DistBackendError) as exc:
                self._check(exc)
            self._work = None
        return self._value


class LocalExecutor:
    """One rank: the runner lives in this process."""

    depth = 1
    # Steps may take input tokens from the sampled ids of the step before, still on the
    # device (the engine launches step n+1 before step n's results are back).
    fills_tokens = True

    def __init__(self, runner) -> None:
        self.runner = runner
        self.stages = [0]  # the pipeline stage of each rank

    def call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.runner, method)(*args)]

    def execute(self, packed: torch.Tensor, tokens: torch.Tensor | None = None) -> Logits:
        return Logits(self.runner.execute(packed, tokens=tokens))

    def shutdown(self) -> None:
        self.runner.release_caches()


def torchrun_rank() -> int | None:
    """This process's rank when started by torchrun (its RANK variable), else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


@dataclass(frozen=True)
class Layout:
    """Where one rank sits in a TP x PP group, and the groups it talks through."""

    rank: int
    tp_size: int
    pp_size: int
    tp: TensorParallel
    control: dist.ProcessGroup  # gloo, every rank: rank 0's commands and results

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1


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


def _join(rank: int, config: EngineConfig, device: torch.device, init_method: str) -> Layout:
    """Join the process group and make the groups (every rank makes all of them, in the
    same order, as torch.distributed requires)."""
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    dist.init_process_group(
        _backend(device),
        init_method=init_method,
        rank=rank,
        world_size=tp_size * pp_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    mine = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        if rank in ranks:
            mine = TensorParallel(rank % tp_size, tp_size, group, cpu_group)
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return Layout(rank, tp_size, pp_size, mine, control)


def _make_runner(layout: Layout, config, model_config, device, dtype):
    from ssmserve.engine.model_runner import ModelRunner
    from ssmserve.models.base import PipelineStage

    stage = None
    if layout.pp_size > 1:
        layers = stage_layers(model_config.hf_config.num_hidden_layers, config)[layout.stage]
        stage = PipelineStage(layers, layout.stage == 0, layout.is_last_stage)
    return ModelRunner(config, model_config, device, dtype, layout.tp, stage)


def _check_shapes(config: EngineConfig, model_config: ModelConfig) -> None:
    """Build each stage's first shard on the meta device: a model that cannot be split
    fails here, with the layer's message, before any worker starts."""
    from ssmserve.kernels import get_ops
    from ssmserve.models.base import ModelContext, PipelineStage
    from ssmserve.models.registry import model_class

    layers = stage_layers(model_config.hf_config.num_hidden_layers, config)
    tp = TensorParallel(rank=0, size=config.tensor_parallel_size)
    for s, stage_range in enumerate(layers):
        stage = PipelineStage(stage_range, s == 0, s == len(layers) - 1)
        ctx = ModelContext(get_ops("torch", "cpu"), tp, stage)
        with torch.device("meta"):
            model_class(model_config.architecture)(model_config.hf_config, ctx)


class DistributedExecutor:
    """Rank 0 of `tensor_parallel_size x pipeline_parallel_size` ranks."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        _check_shapes(config, model_config)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world = tp * pp
        self.depth = pp
        # Tensor parallel alone: a step's fills read the sampled ids of the step before,
        # which rank 0 broadcasts to the other ranks on the device (`execute`). Under
        # pipeline parallelism steps of different requests overlap instead.
        self.fills_tokens = pp == 1
        self.stages = [r // tp for r in range(self.world)]
        self.vocab_size = model_config.vocab_size
        self._procs: list[subprocess.Popen] = []
        self._sends: list[Any] = []  # in-flight sends and their tensors
        self._failed: str | None = None
        self._closed = False
        if torchrun_rank() is None:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            level = logging.getLogger().getEffectiveLevel()
            for rank in range(1, self.world):
                args = (rank, init_method, config, model_config, device, dtype, level)
                self._procs.append(_spawn_worker(args))
            for proc in self._procs:
                threading.Thread(target=self._watch_worker, args=(proc,), daemon=True).start()
        else:
            init_method = "env://"
        try:
            self.layout = _join(0, config, device, init_method)
            self.runner = _make_runner(self.layout, config, model_config, device, dtype)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)
        logger.info("distributed: TP %d x PP %d ranks over %s", tp, pp, _backend(device))

    @property
    def workers(self) -> list[subprocess.Popen]:
        """The worker processes this executor started (none under torchrun)."""
        return list(self._procs)

    def _watch_worker(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closed and self._failed is None:
            self._failed = f"worker (pid {proc.pid}) exited with code {code}"
            logger.error("%s; in-flight requests fail", self._failed)

    def _check(self) -> None:
        if self._closed:
            raise WorkerFailedError("the distributed group is shut down")
        if self._failed:
            raise WorkerFailedError(self._failed)

    def _raise(self, exc: BaseException) -> None:
        if not isinstance(exc, WorkerFailedError):
            self._failed = self._failed or f"a collective failed: {exc}"
            exc = WorkerFailedError(self._failed)
        raise exc

    def _send_all(self, *tensors: torch.Tensor) -> None:
        """Send these tensors to every worker without waiting for them to be received."""
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        for rank in range(1, self.world):
            for t in tensors:
                self._sends.append((dist.isend(t, rank, group=self.layout.control), t))

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run runner.`method`(*args) on every rank; every rank's result, by rank."""
        self._check()
        try:
            self._send_all(torch.tensor([_CALL, 0]))
            message = torch.frombuffer(bytearray(pickle.dumps((method, args))), dtype=torch.uint8)
            self._send_all(torch.tensor([message.numel()]), message)
            result = getattr(self.runner, method)(*args)
            results: list[Any] = [None] * self.world
            dist.gather_object(result, results, dst=0, group=self.layout.control)
            return results
        except (RuntimeError, dist.DistBackendError) as exc:
            self._raise(exc)

    def execute(self, packed: torch.Tensor, tokens: torch.Tensor | None = None) -> Logits:
        """Run a packed step on every rank. `tokens`: the step before's sampled ids on
        this device, which the step's fills read; broadcast to the tensor-parallel ranks
        in stream order (no host copy)."""
        self._check()
        try:
            self._send_all(torch.tensor([_STEP, packed.numel()]), packed)
            needed = sampled_rows_read(packed)
            if needed:
                tokens = tokens[:needed].contiguous()
                dist.broadcast(tokens, 0, group=self.layout.tp.group)
            out = self.runner.execute(packed, tokens=tokens)
            if self.layout.pp_size == 1:
                return Logits(out)
            for t in out.values():
                t = t.contiguous()
                self._sends.append((dist.isend(t, self.layout.tp_size), t))
            num_logits = int(packed[2])
            logits = torch.empty(num_logits, self.vocab_size, device=self.runner.device)
            if num_logits == 0:
                return Logits(logits)
            last = (self.layout.pp_size - 1) * self.layout.tp_size
            return Logits(logits, dist.irecv(logits, last), self._raise)
        except (RuntimeError, dist.DistBackendError) as exc:
            self._raise(exc)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            if not self._failed:
                try:
                    self._send_all(torch.tensor([_EXIT, 0]))
                    for work, _ in self._sends:
                        work.wait()
                except (RuntimeError, dist.DistBackendError):
                    pass
                for proc in self._procs:
                    _wait(proc, 10)
            # NOTE: after a failure the workers left wait in a collective that no longer
            # completes, and no exit message reaches them: they are stopped at once.
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
    cmd = [sys.executable, "-m", "ssmserve.distributed.executor"]
    # The worker imports this very copy of ssmserve, wherever it was imported from.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": root if not path else root + os.pathsep + path}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
    pickle.dump(args, proc.stdin)
    proc.stdin.flush()
    return proc


def _worker_process() -> None:
    """Entry point of a spawned worker: read the arguments, then serve rank 0. The engine
    keeps this process's stdin open; when it closes (the engine exited or died), exit."""
    rank, init_method, config, model_config, device, dtype, level = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")

    def exit_with_parent() -> None:
        # Raw reads of fd 0: a thread blocked in sys.stdin would hold its lock at exit.
        while os.read(sys.stdin.fileno(), 1 << 16):
            pass
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    if device.type == "cpu":
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    run_worker(rank, init_method, config, model_config, _rank_device(device, rank), dtype)


def _recv(n: int, dtype: torch.dtype, group) -> torch.Tensor:
    t = torch.empty(n, dtype=dtype)
    dist.recv(t, 0, group=group)
    return t


def run_worker(
    rank: int,
    init_method: str,
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """A worker rank: build the shard, then serve rank 0's commands until it says exit."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layout = _join(rank, config, device, init_method)
    runner = _make_runner(layout, config, model_config, device, dtype)
    tp = layout.tp_size
    while True:
        cmd, n = _recv(2, torch.long, layout.control).tolist()
        if cmd == _STEP:
            packed = _recv(n, torch.long, layout.control)
            tokens = None
            needed = sampled_rows_read(packed)
            if needed:  # the step before's sampled ids, from rank 0 (tensor parallel)
                tokens = torch.empty(needed, dtype=torch.long, device=runner.device)
                dist.broadcast(tokens, 0, group=layout.tp.group)
            received = None
            if layout.stage > 0:
                received = runner.intermediate_buffers(int(packed[0]))
                for t in received.values():
                    dist.recv(t, rank - tp)
            out = runner.execute(packed, received, tokens)
            if not layout.is_last_stage:
                for t in out.values():
                    dist.send(t.contiguous(), rank + tp)
            elif layout.pp_size > 1 and layout.tp.rank == 0 and out.shape[0]:
                dist.send(out.contiguous(), 0)
        elif cmd == _CALL:
            size = int(_recv(1, torch.long, layout.control))
            method, args = pickle.loads(_recv(size, torch.uint8, layout.control).numpy().tobytes())
            result = getattr(runner, method)(*args)
            dist.gather_object(result, None, dst=0, group=layout.control)
            freeze_engine_objects()  # the build is done in calls; this process is the shard's
        else:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker_process()
