"""The demo (``make demo``): generate with a transformers model bigger than its memory budget.

1. A Llama-style model (about 1 GB of float32 weights, random) is built from a configuration
   and saved as safetensors shards on first run, then reused from the cache.
2. Greedy decoding of the same prompt, each way in a fresh process on one compute thread:
   dense (the whole model in memory), accelerate's disk offload and our residency pool
   (modules streamed two ahead, small tensors pinned, SCHEDULED retention), both with a
   budget of a quarter of the model. A table gives s/token, the speed-up over accelerate,
   the bytes read per token and the peak RSS growth against the budget; every way must
   produce the dense model's tokens.
3. A few requests served concurrently from async code through one pool (each forward in a
   worker thread, as ``async with pool`` users do), against the same requests one at a time:
   requests/s and how many reads the concurrent requests shared.

Run: ``python benchmarks/demo.py [--tokens N] [--requests N] [--tiny] [--cache DIR]``.
Exits 1 when a way produced other tokens than the dense model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _hf_job as job
from _common import format_table

MB = 1e6
MIB = 1 << 20


def main_table(results: list[dict[str, Any]]) -> str:
    accelerate = next(r for r in results if r["mode"] == "accelerate")
    rows = []
    for result in results:
        rows.append(
            [
                result["mode"],
                f"{result['s_per_token']:.3f}",
                f"{accelerate['s_per_token'] / result['s_per_token']:.2f}x",
                f"{result['bytes_read_per_token'] / MB:.0f}",
                f"{result['peak_rss_growth'] / MIB:.0f}",
                f"{result['generate_rss_growth'] / MIB:.0f}",
                f"{result['generate_rss_growth'] / result['budget']:.2f}",
            ]
        )
    headers = [
        "mode",
        "s/token",
        "vs accelerate",
        "MB read/token",
        "peak RSS growth MiB (with loading)",
        "in generate MiB",
        "in generate / budget",
    ]
    return format_table(headers, rows)


@dataclass
class Serving:
    """Requests served one at a time, then all at once, through one pool."""

    requests: int
    sequential_s: float
    concurrent_s: float
    sequential_bytes: int
    concurrent_bytes: int
    same_tokens: bool

    @property
    def shared(self) -> float:
        """The share of the one-at-a-time reads that the concurrent requests did not repeat."""
        return 1 - self.concurrent_bytes / self.sequential_bytes if self.sequential_bytes else 0.0


def serve(path: Path, budget: int, requests: int, tokens: int) -> Serving:
    """Serve ``requests`` prompts from async code through one pool, sequentially then at once."""
    import anyio
    import torch

    from torch_to_nnef.tensor import ResidencyStrategy, TensorResidencyPool, stream_modules

    scratch = tempfile.TemporaryDirectory(prefix="t2n-offload-")
    model = job.load("pool", path, budget, Path(scratch.name))
    inner = model.model  # type: ignore[attr-defined]
    modules = [inner.embed_tokens, *inner.layers, inner.norm, model.lm_head]  # type: ignore[attr-defined]
    vocab = model.config.vocab_size  # type: ignore[attr-defined]
    prompts = [job.prompt(vocab, seed) for seed in range(requests)]

    async def run(concurrently: bool) -> tuple[float, int, list[list[int]]]:
        outputs: list[list[int]] = [[] for _ in prompts]
        async with TensorResidencyPool(
            max_cached_bytes=budget, max_workers=job.WORKERS, strategy=ResidencyStrategy.SCHEDULED
        ) as pool:
            job.pin_small_tensors(pool, model)
            with stream_modules(pool, modules, depth=job.STREAM_DEPTH):

                async def one(index: int) -> None:
                    def forward() -> None:
                        with pool.scope():
                            outputs[index] = job.generate(model, prompts[index], tokens).tolist()

                    await anyio.to_thread.run_sync(forward)

                started = time.perf_counter()
                if concurrently:
                    async with anyio.create_task_group() as group:
                        for index in range(len(prompts)):
                            group.start_soon(one, index)
                else:
                    for index in range(len(prompts)):
                        await one(index)
                seconds = time.perf_counter() - started
            return seconds, pool.stats().bytes_read, outputs

    threads = torch.get_num_threads()
    torch.set_num_threads(job.COMPUTE_THREADS)  # as in the generation job
    try:
        with scratch:
            with TensorResidencyPool(max_cached_bytes=budget) as pool, pool.scope():
                job.generate(model, prompts[0], 1)  # warm-up: first-call costs out of timing
            sequential_s, sequential_bytes, expected = anyio.run(run, False)
            concurrent_s, concurrent_bytes, outputs = anyio.run(run, True)
    finally:
        torch.set_num_threads(threads)
    return Serving(
        requests,
        sequential_s,
        concurrent_s,
        sequential_bytes,
        concurrent_bytes,
        outputs == expected,
    )


def serving_table(serving: Serving) -> str:
    rows = []
    for label, seconds, read in (
        ("one at a time", serving.sequential_s, serving.sequential_bytes),
        (f"{serving.requests} at once", serving.concurrent_s, serving.concurrent_bytes),
    ):
        rows.append([label, f"{serving.requests / seconds:.2f}", f"{read / MB:.0f}"])
    return format_table(["requests", "requests/s", "MB read"], rows)


def conclusion(results: list[dict[str, Any]], serving: Serving | None) -> list[str]:
    by_mode = {r["mode"]: r for r in results}
    pool, accelerate, dense = by_mode["pool"], by_mode["accelerate"], by_mode["dense"]
    speed = accelerate["s_per_token"] / pool["s_per_token"]
    faster = "faster than" if speed > 1 else "slower than"
    lines = [
        f"The pool generated at {speed:.2f}x accelerate's speed ({faster} accelerate) and "
        f"{dense['s_per_token'] / pool['s_per_token']:.2f}x the dense model's, reading "
        f"{pool['bytes_read_per_token'] / MB:.0f} MB per token; during generate its peak RSS "
        f"grew by {pool['generate_rss_growth'] / pool['budget']:.2f}x its budget of "
        f"{pool['budget'] / MB:.0f} MB ({pool['peak_rss_growth'] / MIB:.0f} MiB with loading)."
    ]
    if serving is not None:
        gain = serving.sequential_s / serving.concurrent_s
        lines.append(
            f"{serving.requests} concurrent requests ran at {gain:.2f}x the throughput of the "
            f"same requests one at a time and read {serving.shared:.0%} fewer bytes "
            "(one read served every request waiting for a tensor)."
            if serving.shared > 0
            else f"{serving.requests} concurrent requests ran at {gain:.2f}x the throughput of "
            "the same requests one at a time; they shared no reads."
        )
    return lines


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24, help="tokens generated (default 24)")
    parser.add_argument(
        "--requests", type=int, default=3, help="concurrent requests served (default 3, 0: none)"
    )
    parser.add_argument(
        "--request-tokens", type=int, default=6, help="tokens per served request (default 6)"
    )
    parser.add_argument("--tiny", action="store_true", help="a model of a few MB (a smoke test)")
    parser.add_argument("--cache", type=Path, default=job.DEFAULT_CACHE, help="model cache")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    spec = job.TINY if args.tiny else job.ModelSpec()
    path = job.checkpoint(spec, args.cache)
    budget = spec.weight_bytes // 4
    print(
        f"{spec.family}-style model, {spec.weight_bytes / 1e9:.2f} GB of float32 weights "
        f"({path}); budget {budget / MB:.0f} MB (a quarter); {args.tokens} tokens, greedy.",
        flush=True,
    )
    started = time.perf_counter()
    with job.ModeRunner() as runner:
        results = [
            runner.run(mode, path, budget=budget, tokens=args.tokens)
            for mode in ("dense", "accelerate", "pool")
        ]
    print()
    print(main_table(results))
    print()
    reference = results[0]["tokens"]
    different = [r["mode"] for r in results if r["tokens"] != reference]
    print(
        "tokens: every way produced the dense model's tokens"
        if not different
        else f"tokens: {', '.join(different)} produced other tokens than the dense model"
    )
    serving = None
    if args.requests > 0:
        print(f"\nserving {args.requests} requests of {args.request_tokens} tokens from async code")
        serving = serve(path, budget, args.requests, args.request_tokens)
        print(serving_table(serving))
        if not serving.same_tokens:
            different.append("concurrent serving")
            print("tokens: the concurrent requests produced other tokens than one at a time")
    print()
    for line in conclusion(results, serving):
        print(line)
    print(f"({time.perf_counter() - started:.0f} s)")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
