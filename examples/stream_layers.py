"""Run a model bigger than the memory budget, streaming its layers with prefetch-ahead.

The model's weights are offloaded to disk. A plain synchronous forward runs under
``pool.scope()`` while ``stream_modules`` leases each block's weights when the block starts and
begins loading the next block's, so reads overlap with compute. The same forwards run with
each strategy: on this cyclic access pattern LRU evicts every layer just before it is needed
again, while FIXED and SCHEDULED keep part of the model resident.

Run ``python examples/stream_layers.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence

import torch
from torch import nn

from torch_to_nnef.tensor import (
    OffloadedTensor,
    ResidencyStrategy,
    TensorResidencyPool,
    offload_module,
    stream_modules,
)


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, help="residual blocks (default 16)")
    parser.add_argument("--width", type=int, help="model width (default 1024)")
    parser.add_argument("--passes", type=int, default=4, help="timed forwards (default 4)")
    parser.add_argument("--quick", action="store_true", help="a smaller model (12 x 128)")
    args = parser.parse_args(argv)
    blocks = args.blocks or (12 if args.quick else 16)
    width = args.width or (128 if args.quick else 1024)

    dense = Model(blocks, width)
    model = Model(blocks, width)
    x = torch.randn(8, width)
    with torch.no_grad():
        expected = dense(x)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = model_bytes // 3

    with tempfile.TemporaryDirectory() as offload_dir, torch.no_grad():
        offload_module(model, offload_dir)
        offloaded = [p for p in model.parameters() if isinstance(p, OffloadedTensor)]
        print(
            f"{len(offloaded)} offloaded tensors, {model_bytes / 1e6:.1f} MB, "
            f"streamed through a {budget / 1e6:.1f} MB pool, {args.passes} forwards after a warm-up"
        )
        for strategy in ResidencyStrategy:
            pool = TensorResidencyPool(max_cached_bytes=budget, max_workers=2, strategy=strategy)
            with pool, pool.scope(), stream_modules(pool, model.blocks, depth=1):
                torch.testing.assert_close(model(x), expected)  # warm-up: the first reads
                first_block = [
                    p for p in model.blocks[0].parameters() if isinstance(p, OffloadedTensor)
                ]
                # Past each forward the stream reads the next one's first block ahead: each
                # count waits for those reads, so that both count the same ones.
                _wait_until_resident(pool, first_block)
                warm = pool.stats()
                start = time.perf_counter()
                for _ in range(args.passes):
                    torch.testing.assert_close(model(x), expected)
                elapsed = time.perf_counter() - start
                _wait_until_resident(pool, first_block)
                # Between forwards the stream holds the next forward's first block, read ahead.
                first_bytes = sum(p.payload_nbytes for p in first_block)
                assert pool.resident_bytes <= budget + first_bytes, "the budget holds"
                stats = pool.stats()
            loads = stats.loads - warm.loads
            served = 1 - loads / (len(offloaded) * args.passes)
            print(
                f"{strategy.name:>9}: {elapsed / args.passes * 1e3:7.1f} ms/forward, "
                f"{loads:4d} loads, {(stats.bytes_read - warm.bytes_read) / 1e6:7.1f} MB read, "
                f"{served:6.1%} of accesses served from memory, "
                f"{stats.reused_buffers} loads into reused buffers in all"
            )
    print("every forward equals the dense model's: OK")


def _wait_until_resident(pool: TensorResidencyPool, tensors: Sequence[OffloadedTensor]) -> None:
    """Wait until the pool holds every one of ``tensors`` (the stream's reads ahead ended)."""
    deadline = time.monotonic() + 30
    while not all(pool.is_resident(t) for t in tensors):
        if time.monotonic() > deadline:
            raise TimeoutError("the stream's reads ahead did not end")
        time.sleep(0.001)


if __name__ == "__main__":
    main()
