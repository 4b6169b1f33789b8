"""Run a model straight from a sharded safetensors checkpoint, without copying it.

1. a model is saved as a sharded checkpoint: two ``.safetensors`` shards and the
   ``model.safetensors.index.json`` that maps each tensor to its shard (the layout Hugging Face
   uses);
2. the same architecture is built on the meta device, so its weights take no memory;
3. ``load_offloaded_checkpoint(model, directory)`` binds every parameter to its bytes inside the
   shards: nothing is copied, and the checkpoint is never written;
4. the model runs, directly and streamed through a residency pool, and matches the original.

Needs the ``safetensors`` package (to write the checkpoint as other tools do).
Run ``python examples/checkpoint_in_place.py`` (``--quick`` for a smaller model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from torch_to_nnef.tensor import (
    OffloadedTensor,
    TensorResidencyPool,
    load_offloaded_checkpoint,
    stream_modules,
)


class Model(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.SiLU())
            for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return x


def save_sharded(model: nn.Module, directory: Path) -> list[Path]:
    """Write ``model``'s state dict as two shards and their index; return the shard paths."""
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    names = list(state)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for file_name, keys in shards.items():
        save_file({key: state[key] for key in keys}, directory / file_name)
        weight_map.update(dict.fromkeys(keys, file_name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [directory / file_name for file_name in shards]


def digest(paths: list[Path]) -> str:
    sha = hashlib.sha256()
    for path in paths:
        sha.update(path.read_bytes())
    return sha.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, help="residual blocks (default 12)")
    parser.add_argument("--width", type=int, help="model width (default 768)")
    parser.add_argument("--quick", action="store_true", help="a 4 x 64 model")
    args = parser.parse_args(argv)
    blocks = args.blocks or (4 if args.quick else 12)
    width = args.width or (64 if args.quick else 768)

    torch.manual_seed(0)
    original = Model(blocks, width).eval()
    x = torch.randn(3, width)
    with torch.no_grad():
        expected = original(x)

    with tempfile.TemporaryDirectory() as work, torch.no_grad():
        checkpoint = Path(work) / "checkpoint"
        checkpoint.mkdir()
        shard_paths = save_sharded(original, checkpoint)
        before = digest(shard_paths)
        files_before = sorted(p.name for p in checkpoint.iterdir())
        print(f"saved a sharded checkpoint: {', '.join(files_before)}")

        with torch.device("meta"):
            model = Model(blocks, width).eval()
        copies = Path(work) / "copies"  # where a write would copy a tensor (none happens here)
        load_offloaded_checkpoint(model, checkpoint, offload_dir=copies)
        tensors = [*model.parameters(), *model.buffers()]
        assert all(isinstance(t, OffloadedTensor) for t in tensors)
        in_place = [t for t in tensors if isinstance(t, OffloadedTensor)]
        assert all(not t.owns_payload for t in in_place), "they point into the shards"
        assert {t.offload_path.resolve() for t in in_place} == {p.resolve() for p in shard_paths}
        print(
            f"bound {len(in_place)} tensors of a meta-device model to the shards in place "
            "(no copy made)"
        )

        direct = model(x)
        budget = sum(t.payload_nbytes for t in in_place) // 3
        with (
            TensorResidencyPool(max_cached_bytes=budget) as pool,
            pool.scope(),
            stream_modules(pool, [model.embed, *model.blocks], depth=1),
        ):
            streamed = model(x)
            stats = pool.stats()
        torch.testing.assert_close(direct, expected)
        torch.testing.assert_close(streamed, expected)
        print(
            "outputs equal the original model's, run directly and streamed through a pool "
            f"({stats.loads} loads, {stats.bytes_read / 1e6:.2f} MB read)"
        )

        assert digest(shard_paths) == before, "the checkpoint is unchanged"
        assert sorted(p.name for p in checkpoint.iterdir()) == files_before
        assert not copies.exists() or not any(copies.iterdir()), "nothing was copied"
        print("the checkpoint is byte for byte unchanged and nothing was copied: OK")


if __name__ == "__main__":
    main()
