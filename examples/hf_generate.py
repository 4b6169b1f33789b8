"""Generate with a transformers model whose weights do not fit the memory budget.

1. a Llama-style model is built from a configuration (random weights) and saved with
   ``save_pretrained`` as safetensors shards, as a downloaded model would be;
2. a skeleton of it is built under ``accelerate.init_empty_weights()`` (no memory for its
   weights) and bound to the shards in place with ``t2n_load_checkpoint_and_dispatch``;
3. ``generate()`` runs inside a residency pool whose budget is a quarter of the model, with
   ``stream_modules`` reading the next module while the current one computes;
4. a few requests are served concurrently from async code through one pool, each forward in
   a worker thread; every output is checked against the dense model's.

Needs the ``[hf]`` extra (transformers, accelerate).
Run ``python examples/hf_generate.py`` (``--quick`` for a tiny model).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio
import torch
import transformers
from accelerate import init_empty_weights
from torch import nn

from torch_to_nnef.tensor import (
    ResidencyStrategy,
    TensorResidencyPool,
    stream_modules,
)
from torch_to_nnef.tensor.offload import t2n_load_checkpoint_and_dispatch


def config(quick: bool) -> transformers.LlamaConfig:
    width, layers = (64, 4) if quick else (512, 8)
    return transformers.LlamaConfig(
        hidden_size=width,
        intermediate_size=width * 5 // 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=2048 if quick else 16000,
        initializer_range=0.2,
    )


def generate(model: nn.Module, ids: torch.Tensor, tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return list(out[0, ids.shape[1] :].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model")
    args = parser.parse_args()
    tokens = 6 if args.quick else 16
    prompts = [
        torch.randint(0, 2048, (1, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)
    ]

    with tempfile.TemporaryDirectory() as directory:
        checkpoint, offload_dir = Path(directory) / "model", Path(directory) / "offload"
        torch.manual_seed(0)
        dense = transformers.LlamaForCausalLM(config(args.quick)).eval()
        dense.save_pretrained(checkpoint, max_shard_size="20MB" if not args.quick else "100KB")
        references = [generate(dense, ids, tokens) for ids in prompts]
        weights = sum(p.numel() * p.element_size() for p in dense.parameters())
        del dense
        shards = len(list(checkpoint.glob("*.safetensors")))
        print(f"saved a {weights / 1e6:.1f} MB model in {shards} safetensors shards")

        with init_empty_weights():
            model = transformers.LlamaForCausalLM(config(args.quick)).eval()
        t2n_load_checkpoint_and_dispatch(model, checkpoint, "t2n_offload_disk", offload_dir)
        copied = sum(1 for _ in offload_dir.glob("*")) if offload_dir.exists() else 0
        assert copied == 0
        print("bound the skeleton to the shards in place: nothing copied")

        budget = weights // 4
        inner = model.model
        modules = [inner.embed_tokens, *inner.layers, inner.norm, model.lm_head]
        with (
            TensorResidencyPool(
                max_cached_bytes=budget, max_workers=3, strategy=ResidencyStrategy.SCHEDULED
            ) as pool,
            stream_modules(pool, modules, depth=1),
            pool.scope(),
        ):
            started = time.perf_counter()
            assert generate(model, prompts[0], tokens) == references[0]
            seconds = (time.perf_counter() - started) / tokens
            stats = pool.stats()
        print(
            f"generated {tokens} tokens with a {budget / 1e6:.1f} MB budget: "
            f"{seconds:.3f} s/token, {stats.bytes_read / tokens / 1e6:.1f} MB read per token"
        )

        async def serve() -> list[list[int]]:
            outputs: list[list[int]] = [[] for _ in prompts]
            async with TensorResidencyPool(max_cached_bytes=budget, max_workers=2) as pool:

                async def request(index: int) -> None:
                    def forward() -> None:
                        with pool.scope():
                            outputs[index] = generate(model, prompts[index], tokens)

                    await anyio.to_thread.run_sync(forward)

                async with anyio.create_task_group() as group:
                    for index in range(len(prompts)):
                        group.start_soon(request, index)
            return outputs

        assert anyio.run(serve) == references
        print(f"served {len(prompts)} concurrent requests from async code through one pool")
    print("every output equals the dense model's: OK")


if __name__ == "__main__":
    main()
