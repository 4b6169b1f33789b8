"""Serve many concurrent requests from async code through one residency pool.

The model's weights are offloaded to disk; one ``TensorResidencyPool`` with a budget of about a
third of them serves every request. Two ways of running a request are shown:

- layer by layer, each layer's weights held by ``async with pool.acquire(...)`` while a worker
  thread computes with them, the next layer's weights prefetched meanwhile;
- a plain torch forward in ``anyio.to_thread.run_sync`` under ``pool.scope()``: the offloaded
  parameters resolve through the pool transparently.

Every output is checked against the dense model. Run ``python examples/async_serving.py``
(``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import tempfile

import anyio
import torch
from torch import nn
from torch.nn import functional as F

from torch_to_nnef.tensor import TensorResidencyPool, offload_module


def build_model(layers: int, width: int) -> nn.Sequential:
    """A stack of ``Linear + Tanh`` layers with seeded random weights."""
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))
    )


def apply_layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One ``Linear + Tanh`` layer with the given (resident) weights."""
    return torch.tanh(F.linear(x, weight, bias))


async def layer_by_layer(
    pool: TensorResidencyPool, model: nn.Sequential, x: torch.Tensor
) -> torch.Tensor:
    """One request: lease each layer's weights, prefetch the next layer's, compute in a worker."""
    linears = [block[0] for block in model]
    h = x
    for index, linear in enumerate(linears):
        if index + 1 < len(linears):  # start reading the next layer while this one computes
            pool.prefetch(linears[index + 1].weight)
            pool.prefetch(linears[index + 1].bias)
        async with pool.acquire(linear.weight) as weight, pool.acquire(linear.bias) as bias:
            # The leases keep both values resident while the worker thread uses them.
            h = await anyio.to_thread.run_sync(apply_layer, h, weight, bias)
    return h


async def plain_forward(
    pool: TensorResidencyPool, model: nn.Module, x: torch.Tensor
) -> torch.Tensor:
    """One request: an ordinary forward in a worker thread; the pool serves every weight."""
    with pool.scope():  # a contextvar: it follows the worker thread
        return await anyio.to_thread.run_sync(model, x)


async def serve(
    model: nn.Sequential, inputs: list[torch.Tensor], budget: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], TensorResidencyPool]:
    """Serve every input both ways, all requests concurrently, through one pool."""
    leased: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    scoped: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    async with TensorResidencyPool(max_cached_bytes=budget, max_workers=2) as pool:

        async def request(index: int) -> None:
            leased[index] = await layer_by_layer(pool, model, inputs[index])
            scoped[index] = await plain_forward(pool, model, inputs[index])

        async with anyio.create_task_group() as task_group:
            for index in range(len(inputs)):
                task_group.start_soon(request, index)
        assert pool.resident_bytes <= budget, "nothing is leased any more: the budget holds"
    return leased, scoped, pool


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, help="concurrent requests (default 32)")
    parser.add_argument("--layers", type=int, help="linear layers (default 12)")
    parser.add_argument("--width", type=int, help="model width (default 512)")
    parser.add_argument("--quick", action="store_true", help="8 requests on a 6 x 128 model")
    args = parser.parse_args(argv)
    requests = args.requests or (8 if args.quick else 32)
    layers = args.layers or (6 if args.quick else 12)
    width = args.width or (128 if args.quick else 512)

    dense = build_model(layers, width)
    model = build_model(layers, width)
    inputs = [torch.randn(4, width) for _ in range(requests)]
    with torch.no_grad():
        expected = [dense(x) for x in inputs]
    layer_bytes = (width * width + width) * 4
    budget = layers * layer_bytes // 3

    with tempfile.TemporaryDirectory() as offload_dir, torch.no_grad():
        offload_module(model, offload_dir)
        leased, scoped, pool = anyio.run(serve, model, inputs, budget)
        stats = pool.stats()

    for got_leased, got_scoped, want in zip(leased, scoped, expected, strict=True):
        torch.testing.assert_close(got_leased, want)
        torch.testing.assert_close(got_scoped, want)
    accesses = 2 * 2 * layers * requests  # two tensors per layer, two forwards
    print(
        f"served {requests} concurrent requests twice (leases, then pool.scope) over a "
        f"{layers * layer_bytes / 1e6:.1f} MB model with a {budget / 1e6:.1f} MB budget"
    )
    print(
        f"pool: {stats.loads} loads for {accesses} tensor accesses, {stats.hits} hits, "
        f"{stats.misses} misses, {stats.bytes_read / 1e6:.1f} MB read, "
        f"{stats.evictions} evictions"
    )
    assert stats.load_errors == 0
    print("every output equals the dense model's: OK")


if __name__ == "__main__":
    main()
