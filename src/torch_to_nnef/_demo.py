"""The residency demo: serve a model bigger than its memory budget from async code.

``t2n-residency demo`` (and ``make demo``) runs :func:`run_demo`:

1. build a synthetic model (residual blocks of two square linear layers, float32, random
   weights), compute each request's output with the dense model (the reference), and offload
   the model with :func:`~torch_to_nnef.tensor.offload_module` into a temporary directory;
2. one request at a time (the cyclic workload): time a forward without a pool (load, then
   compute), through the pool without and with prefetch-ahead (and through a pool caching
   nothing), and the ideal ``max(load, compute)``, all in this run, and measure each
   strategy's hit ratio;
3. for each strategy, with and without prefetch, serve a batch of concurrent requests through
   one :class:`~torch_to_nnef.tensor.TensorResidencyPool` whose budget is a fraction of the
   model: each request runs its forward in ``anyio.to_thread.run_sync`` under ``pool.scope()``,
   :func:`~torch_to_nnef.tensor.stream_modules` prefetching the next blocks;
4. compare every streamed output with the reference, print the measurements and explain them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import math
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import anyio
import torch
from torch import nn
from torch.nn import functional as F

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.checkpoint import offload_module
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import ResidencyStrategy, TensorResidencyPool, stream_modules

__all__ = [
    "CyclicResult",
    "DemoConfig",
    "DemoReport",
    "Overlap",
    "RunResult",
    "SyntheticModel",
    "measure",
    "render",
    "run_demo",
]

_GB = 1e9
_MB = 1e6


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoConfig:
    """What the demo builds and serves.

    Attributes:
        model_gb: float32 weight volume of the synthetic model, in GB (1e9 bytes).
        budget_gb: the pool's ``max_cached_bytes`` in GB; ``None``: a quarter of the model.
        strategies: the retention strategies compared.
        device: where the forwards run (``"cpu"`` or ``"cuda:N"``).
        requests: requests served by each serving run.
        concurrency: requests in flight at once (each in its own worker thread).
        blocks: residual blocks of the model (two linear layers each).
        tokens: rows of each request's input.
        depth: blocks prefetched ahead by the prefetching runs.
        passes: timed forwards of each one-request-at-a-time measurement (after a warm-up).
        seed: seed of the weights and inputs.
        torch_threads: intra-op threads of the forwards (one leaves a core to the reads).
        max_workers: concurrent disk reads of the pool.
        progress: show a progress bar on stderr (when tqdm is installed).
    """

    model_gb: float = 1.0
    budget_gb: float | None = None
    strategies: tuple[ResidencyStrategy, ...] = tuple(ResidencyStrategy)
    device: str = "cpu"
    requests: int = 16
    concurrency: int = 4
    blocks: int = 24
    tokens: int = 32
    depth: int = 1
    passes: int = 3
    seed: int = 0
    torch_threads: int = 1
    max_workers: int = 2
    progress: bool = True

    @classmethod
    def quick(cls) -> DemoConfig:
        """Tiny sizes that run in a few seconds (tests, a first look)."""
        return cls(model_gb=0.01, blocks=16, requests=6, concurrency=2, tokens=8)

    @property
    def width(self) -> int:
        """Width of the square linear layers: the multiple of 64 that best fits ``model_gb``."""
        per_layer = self.model_gb * _GB / (2 * self.blocks * 4)
        return max(64, 64 * round(math.sqrt(per_layer) / 64))

    @property
    def model_bytes(self) -> int:
        """Bytes of the model's weights."""
        return 2 * self.blocks * self.width * self.width * 4

    @property
    def budget_bytes(self) -> int:
        """The pool's ``max_cached_bytes``."""
        if self.budget_gb is None:
            return self.model_bytes // 4
        return int(self.budget_gb * _GB)

    def check(self) -> None:
        """Refuse values the demo cannot run with.

        Raises:
            T2NErrorMisuse: a size or count is out of range, or the device is unavailable.
        """
        positive = {
            "model_gb": self.model_gb,
            "requests": self.requests,
            "concurrency": self.concurrency,
            "blocks": self.blocks,
            "tokens": self.tokens,
            "depth": self.depth,
            "passes": self.passes,
            "torch_threads": self.torch_threads,
            "max_workers": self.max_workers,
        }
        for name, value in positive.items():
            if not value > 0:
                raise T2NErrorMisuse(f"{name} must be positive, got {value!r}")
        if self.budget_gb is not None and not self.budget_gb > 0:
            raise T2NErrorMisuse(f"budget_gb must be positive, got {self.budget_gb!r}")
        if not self.strategies:
            raise T2NErrorMisuse("give at least one strategy (lru, fixed, scheduled or all)")
        _check_device(self.device)


def _check_device(name: str) -> None:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise T2NErrorMisuse(f"device must be 'cpu' or 'cuda:N', got {name!r}") from exc
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise T2NErrorMisuse(f"device must be 'cpu' or 'cuda:N', got {name!r}")
    if not torch.cuda.is_available():
        raise T2NErrorMisuse(
            f"device {name!r} needs a CUDA build of torch and a visible GPU, and this machine "
            "has none: use --device cpu"
        )
    if (device.index or 0) >= torch.cuda.device_count():
        raise T2NErrorMisuse(
            f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)"
        )


# ---------------------------------------------------------------------------------------------
# The synthetic model
# ---------------------------------------------------------------------------------------------
class _Block(nn.Module):
    """A residual MLP block without biases: ``x + down(gelu(up(rms_norm(x))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width, bias=False)
        self.down = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],))
        out: torch.Tensor = x + self.down(F.gelu(self.up(h)))
        return out


class SyntheticModel(nn.Module):
    """A stack of residual blocks of two square linear layers (float32, no biases).

    Args:
        blocks: number of blocks.
        width: input and output width of every linear layer.
    """

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run ``x`` (``(tokens, width)``) through every block."""
        for block in self.blocks:
            x = block(x)
        return x


def _build(config: DemoConfig) -> tuple[SyntheticModel, list[torch.Tensor]]:
    """The dense model and the requests' inputs, drawn from ``config.seed`` alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = SyntheticModel(config.blocks, config.width).eval()
        model.requires_grad_(False)
        inputs = [torch.randn(config.tokens, config.width) for _ in range(config.requests)]
    return model, inputs


def _tensors_per_pass(model: SyntheticModel) -> int:
    """Offloaded tensors one forward uses (each is accessed once per forward)."""
    return sum(isinstance(p, OffloadedTensor) for p in model.blocks.parameters())


# ---------------------------------------------------------------------------------------------
# Measuring instruments
# ---------------------------------------------------------------------------------------------
class _StallTimer:
    """Time the forwards spend in the streaming pre-hooks, waiting for their weights.

    Installed after :func:`stream_modules`: a pre-hook put first starts a per-thread clock and
    a pre-hook put last stops it, so what lies between is the stream's lease waits (plus a few
    microseconds of hook overhead). The total is summed over all forwards.
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.total = 0.0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._handles: list[Any] = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._start, prepend=True))
            self._handles.append(module.register_forward_pre_hook(self._stop))

    def _start(self, module: nn.Module, args: Any) -> None:
        self._local.started = time.perf_counter()

    def _stop(self, module: nn.Module, args: Any) -> None:
        waited = time.perf_counter() - self._local.started
        with self._lock:
            self.total += waited

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _release_freed_memory() -> None:
    """Collect garbage and give freed heap memory back to the OS (glibc), before a baseline."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


class _RssSampler:
    """The peak resident set size of this process while it runs, sampled by a thread."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil  # type: ignore[import-untyped]

        _release_freed_memory()
        self._process = psutil.Process()
        self._interval = interval
        self._stopped = threading.Event()
        self.baseline = self._rss()
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, name="t2n-demo-rss", daemon=True)

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopped.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        """Peak RSS above the RSS when sampling began, in bytes."""
        return self.peak - self.baseline


class _Progress:
    """A tqdm progress bar over every forward of the demo; nothing without tqdm."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]
            except ImportError:
                return
            self._bar = tqdm(total=total, unit="forward", file=sys.stderr, dynamic_ncols=True)

    def stage(self, description: str) -> None:
        """Show what runs now."""
        if self._bar is not None:
            self._bar.set_description(description)

    def advance(self) -> None:
        """Count one more forward done."""
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        """Close the bar (it stays on screen)."""
        if self._bar is not None:
            self._bar.close()


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_peak_start(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _gpu_peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


# ---------------------------------------------------------------------------------------------
# One request at a time: the cyclic workload and the overlap of reads with compute
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Overlap:
    """One forward without a pool, timed part by part (seconds, best of the passes).

    Attributes:
        load_s: reading every weight (into reused buffers, then to the device).
        compute_s: computing every block with its weights in memory.
        sequential_s: the whole forward, each block loading its weights then computing.
    """

    load_s: float
    compute_s: float
    sequential_s: float

    @property
    def ideal_s(self) -> float:
        """A perfect overlap of the reads with the compute: ``max(load, compute)``."""
        return max(self.load_s, self.compute_s)

    def efficiency(self, pipelined_s: float) -> float:
        """``(sequential - pipelined) / (sequential - ideal)``: 1 is a perfect overlap, 0 none."""
        gain = self.sequential_s - self.ideal_s
        if gain <= 0:
            return float("nan")
        return (self.sequential_s - pipelined_s) / gain


@dataclass(frozen=True)
class CyclicResult:
    """Forwards of one request after another through a pool: the cyclic access pattern.

    Attributes:
        strategy: the pool's strategy.
        depth: blocks prefetched ahead (0: none).
        cached: whether the pool had the demo's budget (otherwise 0: it caches nothing).
        forward_s: the fastest timed forward.
        loads: payloads read during the timed forwards (after a warm-up forward).
        bytes_read: bytes read during the timed forwards.
        accesses: tensor accesses of the timed forwards.
        outputs: the output of every forward, warm-up included, on the CPU.
    """

    strategy: ResidencyStrategy
    depth: int
    cached: bool
    forward_s: float
    loads: int
    bytes_read: int
    accesses: int
    outputs: list[torch.Tensor] = field(repr=False)

    @property
    def hit_ratio(self) -> float:
        """Fraction of tensor accesses served without a disk read: ``1 - loads / accesses``."""
        return 1.0 - self.loads / self.accesses


def _sequential_forward(
    model: SyntheticModel, x: torch.Tensor, device: torch.device
) -> tuple[Overlap, torch.Tensor]:
    """No pool: each block reads its weights into reused host buffers, then computes.

    The blocks all have the parameters of the first one (same names and shapes), and each
    payload file, written by ``offload_module``, holds one plain tensor.
    """
    first = model.blocks[0]
    buffers = {
        name: torch.empty(tuple(w.shape), dtype=w.dtype) for name, w in first.named_parameters()
    }
    layouts: dict[int, storage.PayloadLayout] = {}
    for weight in model.blocks.parameters():
        assert isinstance(weight, OffloadedTensor)
        layouts[id(weight)] = storage.read_layout(weight.offload_path)
    load_s = compute_s = 0.0
    start = time.perf_counter()
    with torch.no_grad():
        h = x.to(device)
        for block in model.blocks:
            began = time.perf_counter()
            weights = {}
            for name, weight in block.named_parameters():
                layout = layouts[id(weight)]
                (entry,) = layout.entries
                host = storage.read_payload(layout, out={entry: buffers[name]})[entry]
                weights[name] = host.to(device)
            _synchronize(device)
            loaded = time.perf_counter()
            h = torch.func.functional_call(block, weights, (h,))
            _synchronize(device)
            load_s += loaded - began
            compute_s += time.perf_counter() - loaded
    wall_s = time.perf_counter() - start
    return Overlap(load_s, compute_s, wall_s), h.cpu()


def _cyclic(
    model: SyntheticModel,
    x: torch.Tensor,
    config: DemoConfig,
    strategy: ResidencyStrategy,
    depth: int,
    progress: _Progress,
    *,
    cached: bool = True,
) -> CyclicResult:
    """A warm-up forward, then ``config.passes`` timed ones, streamed through a fresh pool
    with the demo's budget, or caching nothing."""
    device = torch.device(config.device)

    def forward() -> torch.Tensor:
        output: torch.Tensor = model(x.to(device)).cpu()  # a copy to the host synchronizes
        progress.advance()
        return output

    budget = config.budget_bytes if cached else 0
    pool = TensorResidencyPool(budget, config.max_workers, strategy)
    with (
        pool,
        stream_modules(pool, model.blocks, depth=depth, device=device),
        pool.scope(device),
        torch.no_grad(),
    ):
        outputs = [forward()]  # the warm-up: the first reads of every strategy
        warm = pool.stats()
        times = []
        for _ in range(config.passes):
            start = time.perf_counter()
            outputs.append(forward())
            times.append(time.perf_counter() - start)
        stats = pool.stats()
    return CyclicResult(
        strategy=strategy,
        depth=depth,
        cached=cached,
        forward_s=min(times),
        loads=stats.loads - warm.loads,
        bytes_read=stats.bytes_read - warm.bytes_read,
        accesses=_tensors_per_pass(model) * config.passes,
        outputs=outputs,
    )


def _one_at_a_time(
    model: SyntheticModel, x: torch.Tensor, config: DemoConfig, progress: _Progress
) -> tuple[Overlap, list[torch.Tensor], list[CyclicResult]]:
    """The sequential baseline, LRU without prefetch, every strategy with prefetch, then a
    pool that caches nothing (the pipeline alone)."""
    device = torch.device(config.device)
    progress.stage("one request at a time")
    sequential = []
    outputs = []
    for _ in range(config.passes):
        overlap, output = _sequential_forward(model, x, device)
        sequential.append(overlap)
        outputs.append(output)
        progress.advance()
    best = Overlap(
        min(s.load_s for s in sequential),
        min(s.compute_s for s in sequential),
        min(s.sequential_s for s in sequential),
    )
    cyclic = [_cyclic(model, x, config, ResidencyStrategy.LRU, 0, progress)]
    for strategy in _with_lru(config.strategies):
        cyclic.append(_cyclic(model, x, config, strategy, config.depth, progress))
    lru = ResidencyStrategy.LRU
    cyclic.append(_cyclic(model, x, config, lru, config.depth, progress, cached=False))
    return best, outputs, cyclic


def _with_lru(strategies: Sequence[ResidencyStrategy]) -> list[ResidencyStrategy]:
    """LRU first (the overlap measurement needs a pool that reads every layer), then the rest."""
    return [ResidencyStrategy.LRU, *(s for s in strategies if s is not ResidencyStrategy.LRU)]


# ---------------------------------------------------------------------------------------------
# Serving concurrent requests from async code
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunResult:
    """Measurements of one serving run (one strategy, one prefetch depth).

    Attributes:
        strategy: the pool's strategy.
        depth: blocks prefetched ahead by :func:`stream_modules` (0: none).
        wall_s: wall time of the whole batch of requests.
        loads: payloads read from disk.
        bytes_read: bytes read from disk.
        accesses: tensor accesses of all forwards (tensors per forward x requests).
        stall_s: time the forwards spent waiting for their weights (summed over requests).
        forward_s: time the forwards took (summed over requests).
        rss_growth: peak RSS above the RSS before the run, in bytes.
        gpu_peak: peak memory allocated on the GPU (``None`` on the CPU).
        outputs: each request's output, on the CPU.
    """

    strategy: ResidencyStrategy
    depth: int
    wall_s: float
    loads: int
    bytes_read: int
    accesses: int
    stall_s: float
    forward_s: float
    rss_growth: int
    gpu_peak: int | None
    outputs: list[torch.Tensor] = field(repr=False)

    @property
    def hit_ratio(self) -> float:
        """Fraction of tensor accesses served without a disk read: ``1 - loads / accesses``."""
        return 1.0 - self.loads / self.accesses


def _forward(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, float]:
    """One request, in a worker thread: its output (on the CPU) and the forward's duration."""
    start = time.perf_counter()
    with torch.no_grad():
        y = model(x.to(device))
    _synchronize(device)
    return y.cpu(), time.perf_counter() - start


async def _serve(
    model: SyntheticModel,
    inputs: Sequence[torch.Tensor],
    config: DemoConfig,
    strategy: ResidencyStrategy,
    depth: int,
    progress: _Progress,
) -> RunResult:
    """Serve every input as a concurrent request through one pool, and measure the run."""
    device = torch.device(config.device)
    outputs: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    forward_s = [0.0] * len(inputs)
    limiter = anyio.CapacityLimiter(config.concurrency)
    pool = TensorResidencyPool(config.budget_bytes, config.max_workers, strategy)
    _gpu_peak_start(device)
    with _RssSampler() as rss:
        async with pool:
            stream = stream_modules(pool, model.blocks, depth=depth, device=device)
            timer = _StallTimer(model.blocks)
            try:

                async def request(index: int) -> None:
                    with pool.scope(device):
                        outputs[index], forward_s[index] = await anyio.to_thread.run_sync(
                            _forward, model, inputs[index], device, limiter=limiter
                        )
                    progress.advance()

                start = time.perf_counter()
                async with anyio.create_task_group() as task_group:
                    for index in range(len(inputs)):
                        task_group.start_soon(request, index)
                wall_s = time.perf_counter() - start
            finally:
                timer.close()
                stream.close()
            stats = pool.stats()
    return RunResult(
        strategy=strategy,
        depth=depth,
        wall_s=wall_s,
        loads=stats.loads,
        bytes_read=stats.bytes_read,
        accesses=_tensors_per_pass(model) * len(inputs),
        stall_s=timer.total,
        forward_s=sum(forward_s),
        rss_growth=rss.growth,
        gpu_peak=_gpu_peak(device),
        outputs=outputs,
    )


def _run_serving(
    model: SyntheticModel,
    inputs: Sequence[torch.Tensor],
    config: DemoConfig,
    strategy: ResidencyStrategy,
    depth: int,
    progress: _Progress,
) -> RunResult:
    """One serving run in its own event loop (uvloop when installed)."""
    backend_options: dict[str, Any] = {}
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401

        backend_options["use_uvloop"] = True
    progress.stage(f"serving, {strategy.name}, prefetch {depth}")
    result: RunResult = anyio.run(
        _serve,
        model,
        inputs,
        config,
        strategy,
        depth,
        progress,
        backend="asyncio",
        backend_options=backend_options,
    )
    return result


# ---------------------------------------------------------------------------------------------
# The whole demo
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoReport:
    """Everything :func:`measure` measured.

    Attributes:
        config: what was run.
        tensors_per_pass: offloaded tensors one forward uses.
        layers_per_pass: linear layers one forward runs.
        overlap: the forward without a pool, part by part.
        cyclic: one request at a time through a pool: LRU without prefetch, then each
            strategy (LRU first) with prefetch, then LRU with prefetch caching nothing.
        runs: the serving runs, in the order they ran.
        max_abs_diff: largest difference between a streamed output and the dense forward.
        tolerance: the largest difference accepted.
        verified_outputs: how many outputs were compared with the dense forward.
        setup_s: building the model, computing the references and offloading it.
        total_s: the whole demo.
    """

    config: DemoConfig
    tensors_per_pass: int
    layers_per_pass: int
    overlap: Overlap
    cyclic: list[CyclicResult]
    runs: list[RunResult]
    max_abs_diff: float
    tolerance: float
    verified_outputs: int
    setup_s: float
    total_s: float

    @property
    def verified(self) -> bool:
        """Whether every streamed output equals the dense forward (within ``tolerance``)."""
        return self.max_abs_diff <= self.tolerance


def _max_abs_diff(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return max(float((output - reference).abs().max()) for output, reference in pairs)


def _tolerance(device: torch.device, references: Sequence[torch.Tensor]) -> float:
    scale = max(1.0, max(float(r.abs().max()) for r in references))
    return (1e-5 if device.type == "cpu" else 1e-3) * scale


def _forwards(config: DemoConfig) -> int:
    one_at_a_time = config.passes + (2 + len(_with_lru(config.strategies))) * (config.passes + 1)
    return one_at_a_time + 2 * len(config.strategies) * config.requests


def measure(config: DemoConfig, *, log: Callable[[str], None] | None = None) -> DemoReport:
    """Build, offload and serve the demo model as ``config`` says; return the measurements.

    Args:
        config: what to build and serve.
        log: receives a line at each stage (e.g. ``print``); silent when ``None``.

    Raises:
        T2NErrorMisuse: ``config`` is out of range or names an unavailable device.
        ImportError: psutil (of the ``demo`` extra) is not installed.
    """
    config.check()
    say = log if log is not None else (lambda line: None)
    device = torch.device(config.device)
    started = time.perf_counter()
    with (
        _torch_threads(config.torch_threads),
        tempfile.TemporaryDirectory(prefix="t2n-demo-") as offload_dir,
    ):
        say(
            f"building a {config.blocks}-block model of width {config.width} "
            f"({config.model_bytes / _MB:.0f} MB of float32 weights)"
        )
        model, inputs = _build(config)
        with torch.no_grad():
            references = [model(x) for x in inputs]
        say(f"offloading it to {offload_dir}")
        offload_module(model, offload_dir)
        setup_s = time.perf_counter() - started
        progress = _Progress(_forwards(config), config.progress)
        try:
            overlap, sequential, cyclic = _one_at_a_time(model, inputs[0], config, progress)
            runs = []
            for strategy in config.strategies:
                for depth in (config.depth, 0):
                    runs.append(_run_serving(model, inputs, config, strategy, depth, progress))
        finally:
            progress.close()
        tensors_per_pass = _tensors_per_pass(model)
        layers_per_pass = sum(isinstance(m, nn.Linear) for m in model.blocks.modules())
        del model
    pairs = [(output, references[0]) for output in sequential]
    pairs += [(output, references[0]) for result in cyclic for output in result.outputs]
    for run in runs:
        pairs += zip(run.outputs, references, strict=True)
    return DemoReport(
        config=config,
        tensors_per_pass=tensors_per_pass,
        layers_per_pass=layers_per_pass,
        overlap=overlap,
        cyclic=cyclic,
        runs=runs,
        max_abs_diff=_max_abs_diff(pairs),
        tolerance=_tolerance(device, references),
        verified_outputs=len(pairs),
        setup_s=setup_s,
        total_s=time.perf_counter() - started,
    )


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An aligned plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _prefetch_label(depth: int) -> str:
    return f"depth {depth}" if depth else "none"


def _one_at_a_time_table(report: DemoReport) -> str:
    o = report.overlap
    mb = report.config.model_bytes / _GB
    rows = [
        [
            "no pool: load, then compute",
            "-",
            "none",
            f"{o.sequential_s:.3f}",
            "0.00",
            "0.000",
            f"{mb:.2f}",
        ]
    ]
    for result in report.cyclic:
        every_layer_read = result.strategy is ResidencyStrategy.LRU
        efficiency = f"{o.efficiency(result.forward_s):.2f}" if every_layer_read else "-"
        rows.append(
            [
                "pool" if result.cached else "pool caching nothing",
                result.strategy.name,
                _prefetch_label(result.depth),
                f"{result.forward_s:.3f}",
                efficiency,
                f"{result.hit_ratio:.3f}",
                f"{result.bytes_read / report.config.passes / _GB:.2f}",
            ]
        )
    ideal = f"ideal: max(load {o.load_s:.3f}, compute {o.compute_s:.3f})"
    rows.append([ideal, "-", "-", f"{o.ideal_s:.3f}", "1.00", "-", "-"])
    headers = [
        "one request at a time",
        "strategy",
        "prefetch",
        "forward s",
        "overlap efficiency",
        "hit ratio",
        "GB read/forward",
    ]
    return format_table(headers, rows)


def _serving_table(report: DemoReport) -> str:
    budget = report.config.budget_bytes
    headers = [
        "strategy",
        "prefetch",
        "requests/s",
        "layers/s",
        "GB read",
        "read GB/s",
        "hit ratio",
        "stall s",
        "stall %",
        "peak RSS MB",
        "RSS/budget",
    ]
    gpu = any(run.gpu_peak is not None for run in report.runs)
    if gpu:
        headers.append("peak GPU MB")
    rows = []
    for run in report.runs:
        layers = report.layers_per_pass * len(run.outputs)
        row = [
            run.strategy.name,
            _prefetch_label(run.depth),
            f"{len(run.outputs) / run.wall_s:.2f}",
            f"{layers / run.wall_s:.0f}",
            f"{run.bytes_read / _GB:.2f}",
            f"{run.bytes_read / _GB / run.wall_s:.2f}",
            f"{run.hit_ratio:.3f}",
            f"{run.stall_s:.2f}",
            f"{100 * run.stall_s / run.forward_s:.0f}",
            f"{run.rss_growth / _MB:.0f}",
            f"{run.rss_growth / budget:.2f}",
        ]
        if gpu:
            row.append(f"{(run.gpu_peak or 0) / _MB:.0f}")
        rows.append(row)
    return format_table(headers, rows)


def _explanation(report: DemoReport) -> str:
    config = report.config
    o = report.overlap
    lru = next(r for r in report.cyclic if r.strategy is ResidencyStrategy.LRU and r.depth)
    no_prefetch = report.cyclic[0]
    uncached = report.cyclic[-1]
    sentences = [
        f"The model ({config.blocks} blocks of two {config.width}x{config.width} linear "
        f"layers, {config.model_bytes / _MB:.0f} MB) was offloaded to disk and run through "
        f"one TensorResidencyPool holding about {config.budget_bytes / _MB:.0f} MB of weights "
        "(a soft limit: the blocks leased by forwards in flight stay resident above it).",
        "Every forward reads the layers in the same cyclic order, so LRU evicts each layer just "
        f"before it is needed again (hit ratio {lru.hit_ratio:.2f} one request at a time)",
    ]
    others = [r for r in report.cyclic if r.strategy is not ResidencyStrategy.LRU and r.cached]
    if others:
        sentences[-1] += ", while " + " and ".join(
            f"{r.strategy.name} served {r.hit_ratio:.0%}" for r in others
        )
        sentences[-1] += (
            " of the accesses from memory by keeping a stable part of the model resident"
        )
    sentences[-1] += "."
    sentences.append(
        f"Prefetching {config.depth} block(s) ahead overlaps the reads with the compute: one "
        f"forward took {lru.forward_s:.3f} s against {o.sequential_s:.3f} s for "
        f"load-then-compute without a pool ({no_prefetch.forward_s:.3f} s through the pool "
        f"without prefetch) and {o.ideal_s:.3f} s for a perfect overlap, an overlap efficiency "
        f"of {o.efficiency(lru.forward_s):.2f}. A pool caching nothing, which holds just the "
        f"block computing and the one read ahead, took {uncached.forward_s:.3f} s (efficiency "
        f"{o.efficiency(uncached.forward_s):.2f}): under LRU a cache smaller than one pass "
        "never hits, and each read lands in the buffer of the layer longest unused."
    )
    if report.runs:
        with_prefetch = [r for r in report.runs if r.depth]
        without = [r for r in report.runs if not r.depth]
        sentences.append(
            f"Serving {config.requests} requests {config.concurrency} at a time from async code "
            "(each forward in a worker thread), concurrent forwards also share the reads of the "
            "layers they need at the same time, which raises every strategy's hit ratio; with "
            f"prefetch the forwards waited {sum(r.stall_s for r in with_prefetch):.2f} s for "
            f"weights in all, against {sum(r.stall_s for r in without):.2f} s without."
        )
    sentences.append(
        f"All {report.verified_outputs} streamed outputs were compared with the dense model's "
        f"forward: largest difference {report.max_abs_diff:.1e}."
    )
    return _wrap(" ".join(sentences))


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=100)


def _lease_bytes(config: DemoConfig) -> int:
    """Bytes the forwards in flight may lease at once: their block and the blocks ahead."""
    block_bytes = config.model_bytes // config.blocks
    return config.concurrency * (config.depth + 1) * block_bytes


def render(report: DemoReport) -> str:
    """The demo's printout: two tables, the verification, the timing and an explanation."""
    config = report.config
    verdict = "OK" if report.verified else "MISMATCH"
    size = (
        f"the model's {config.model_bytes / _MB:.0f} MB ({report.tensors_per_pass} offloaded "
        f"tensors per forward) streamed through a {config.budget_bytes / _MB:.0f} MB pool"
    )
    lines = [
        "",
        _wrap(
            f"One request at a time on {config.device}: {size}; best of {config.passes} "
            "forwards after a warm-up"
        ),
        "",
        _one_at_a_time_table(report),
        "",
        _wrap(
            "overlap efficiency = (sequential - pipelined) / (sequential - ideal), for the pools "
            "that read every layer; hit ratio over the timed forwards (a value read ahead and "
            "evicted before its use is read twice, so a strategy that keeps nothing can show "
            "slightly below 0)."
        ),
        "",
        _wrap(
            f"Serving {config.requests} concurrent requests, {config.concurrency} in flight, "
            f"from async code on {config.device}: {size}"
        ),
        "",
        _serving_table(report),
        "",
        _wrap(
            "hit ratio = 1 - loads / (tensors per forward x forwards); stall = time the "
            "forwards waited for their weights, summed over requests (% of forward time); "
            "peak RSS = growth over the RSS before the run: the budget bounds the values the "
            f"pool retains, and the {config.concurrency} forwards in flight each lease their "
            f"current block and {config.depth} ahead, up to {_lease_bytes(config) / _MB:.0f} MB "
            "more."
        ),
        "",
        f"verification: {report.verified_outputs} streamed outputs vs the dense forward, "
        f"max |diff| = {report.max_abs_diff:.1e} (tolerance {report.tolerance:.1e}): {verdict}",
        f"time: setup {report.setup_s:.1f} s, total {report.total_s:.1f} s",
        "",
        _explanation(report),
        "",
    ]
    return "\n".join(lines)


def run_demo(config: DemoConfig, out: TextIO | None = None) -> int:
    """Run the demo and print its report to ``out`` (stdout by default).

    Returns:
        0 when every streamed output equals the dense forward, 1 otherwise.

    Raises:
        T2NErrorMisuse: ``config`` is out of range or names an unavailable device.
        ImportError: psutil (of the ``demo`` extra) is not installed.
    """
    stream = sys.stdout if out is None else out

    def log(line: str) -> None:
        print(line, file=stream, flush=True)

    report = measure(config, log=log)
    print(render(report), file=stream, flush=True)
    return 0 if report.verified else 1
