"""Errors at the public boundary: each says what was wrong and what to do."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import safetensors.torch
import torch
from torch import nn

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor import (
    OffloadedTensor,
    TensorResidencyPool,
    offload_module,
    stream_modules,
)


def test_stream_modules_given_one_module_asks_for_its_layers(tmp_path: Path) -> None:
    model = offload_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), tmp_path)
    with TensorResidencyPool() as pool:
        with pytest.raises(T2NErrorMisuse) as raised:
            stream_modules(pool, model[0])  # type: ignore[arg-type]
        message = str(raised.value)
        for words in ("got a single Linear", "list(model)", "[module]"):
            assert words in message, message
        with pytest.raises(T2NErrorMisuse, match=r"got a list holding \['OffloadedTensor'\]"):
            stream_modules(pool, [model[0].weight])  # type: ignore[list-item]
        with stream_modules(pool, model), stream_modules(pool, [model[0]]):
            pass  # a Sequential and a list of one module are layers


def test_stream_modules_given_a_module_twice_asks_for_each_once(tmp_path: Path) -> None:
    """Listed twice, a module had each of its calls hooked twice, with one call for two
    entries: after a Ctrl-C inside it, leases stayed held past later forwards."""
    model = offload_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), tmp_path)
    hooks = len(model[1]._forward_pre_hooks)
    with TensorResidencyPool() as pool:
        with pytest.raises(T2NErrorMisuse) as raised:
            stream_modules(pool, [model[0], model[1], model[1]])
        message = str(raised.value)
        for words in ("same Linear twice (at 1 and 2)", "list each module once", "each call"):
            assert words in message, message
        assert len(model[1]._forward_pre_hooks) == hooks  # nothing was hooked
        x = torch.ones(1, 4)
        expected = model(x)  # (read through the tensors)
        with stream_modules(pool, list(model)):
            assert torch.equal(model(x), expected)


def test_prefetch_of_a_module_names_its_tensors(tmp_path: Path) -> None:
    """The advice works as written on a layer whose bias stayed in memory (``min_bytes``)."""
    layer = offload_module(nn.Linear(16, 16), tmp_path, min_bytes=256)
    assert not isinstance(layer.bias, OffloadedTensor)
    with TensorResidencyPool() as pool:
        with pytest.raises(T2NErrorMisuse) as raised:
            pool.prefetch(layer)  # type: ignore[arg-type]
        message = str(raised.value)
        assert "already resident" not in message
        advice = "for t in module.parameters(): if isinstance(t, OffloadedTensor): pool.prefetch(t)"
        for words in ("a module (Linear)", advice, "stream_modules"):
            assert words in message, message
        module = layer
        for t in module.parameters():
            if isinstance(t, OffloadedTensor):
                pool.prefetch(t).wait()
        assert pool.is_resident(layer.weight)


def test_a_pools_budget_workers_and_strategy_are_fixed_at_creation() -> None:
    """Assigned, the budget was taken (the pool's repr showed it) but never enforced."""
    with TensorResidencyPool(1024, max_workers=2) as pool:
        for name, value in (("max_cached_bytes", 0), ("max_workers", 4), ("strategy", None)):
            with pytest.raises(T2NErrorMisuse, match=f"{name} is fixed when it is created"):
                setattr(pool, name, value)
        assert (pool.max_cached_bytes, pool.max_workers) == (1024, 2)


def test_a_string_that_names_no_device_is_refused_by_name(tmp_path: Path) -> None:
    model = offload_module(nn.Sequential(nn.Linear(4, 4)), tmp_path)
    weight = model[0].weight
    with TensorResidencyPool() as pool:
        for call in (
            lambda: pool.resolve(weight, device="nope"),
            lambda: pool.acquire(weight, device="nope"),
            lambda: pool.prefetch(weight, device="nope"),
            lambda: pool.scope(device="nope").__enter__(),
            lambda: stream_modules(pool, list(model), device="nope"),
        ):
            with pytest.raises(T2NErrorMisuse, match="'nope' is not a device"):
                call()
        pool.resolve(weight)  # the pool goes on serving


@pytest.mark.parametrize("kind", ["mps", "xpu"])
def test_a_backend_this_torch_lacks_is_refused_where_it_is_named(tmp_path: Path, kind: str) -> None:
    """``"mps"`` or ``"xpu"`` on a build without them is refused by every call that takes a
    device, as a misuse naming it (the calls took it; the loads failed later, as a storage
    error, or reads outside a pool with torch's own ``RuntimeError`` or ``AssertionError``)."""
    usable = getattr(torch.backends, kind, None) or getattr(torch, kind, None)
    if usable is not None and hasattr(usable, "is_available") and usable.is_available():
        pytest.skip(f"{kind} is usable here")
    model = offload_module(nn.Sequential(nn.Linear(4, 4)), tmp_path)
    weight = model[0].weight
    with TensorResidencyPool() as pool:
        for call in (
            lambda: pool.resolve(weight, device=kind),
            lambda: pool.acquire(weight, device=kind),
            lambda: pool.prefetch(weight, device=kind),
            lambda: pool.scope(device=kind).__enter__(),
            lambda: stream_modules(pool, list(model), device=kind),
            lambda: weight.reload(kind),
            lambda: weight.to(kind),
        ):
            with pytest.raises(T2NErrorMisuse, match=f"cannot place tensors on {kind}"):
                call()
        assert weight.device == torch.device("cpu")
        pool.resolve(weight)  # the pool goes on serving


def test_schedules_and_streams_given_something_else_say_what_they_take(tmp_path: Path) -> None:
    model = offload_module(nn.Sequential(nn.Linear(4, 4)), tmp_path)
    with TensorResidencyPool() as pool:
        for wrong in (None, 42, model[0].weight):
            with pytest.raises(T2NErrorMisuse, match="declare_schedule takes the offloaded"):
                pool.declare_schedule(wrong)  # type: ignore[arg-type]
        with pytest.raises(T2NErrorMisuse, match="streams through a TensorResidencyPool"):
            stream_modules(None, list(model))  # type: ignore[arg-type]
        with pytest.raises(T2NErrorMisuse, match="depth must be an int >= 0, got True"):
            stream_modules(pool, list(model), depth=True)


def test_budgets_are_read_from_sizes_in_words() -> None:
    assert TensorResidencyPool(max_cached_bytes="1.5GB").max_cached_bytes == 1_500_000_000
    assert TensorResidencyPool(max_cached_bytes="512MiB").max_cached_bytes == 512 << 20
    with pytest.raises(T2NErrorMisuse) as raised:
        TensorResidencyPool(max_cached_bytes="1.5 gigs")
    for words in ("cannot read '1.5 gigs' as a size", "'1.5GB'", "'512MiB'"):
        assert words in str(raised.value)


@pytest.mark.timeout(30)
def test_async_acquire_on_a_closed_pool_says_closed(tmp_path: Path) -> None:
    model = offload_module(nn.Linear(4, 4), tmp_path)

    async def main() -> None:
        async with TensorResidencyPool() as pool:
            pass
        with pytest.raises(T2NErrorMisuse) as raised:
            async with pool.acquire(model.weight):
                pass
        assert str(raised.value) == "the TensorResidencyPool is closed; create a new pool"

    anyio.run(main)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_pools_leases_and_handles_refuse_to_be_copied(tmp_path: Path, how: str) -> None:
    """A copied lease ended the same lease twice (a lease count of -1, and close() then
    refused for a value nobody held); a copied pool shared its threads with the original,
    whose collection closed both; a copied stream shared its hooks. Each refuses, saying
    what to do."""
    import copy
    import pickle

    import torch

    from torch_to_nnef.tensor import OffloadedTensor

    copier = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    t = OffloadedTensor.from_original_tensor(torch.ones(8), "w", offload_dir=tmp_path)
    with TensorResidencyPool() as pool:
        lease = pool.acquire(t)
        handle = pool.prefetch(t)
        model = offload_module(nn.Sequential(nn.Linear(4, 4)), tmp_path / "model")
        stream = stream_modules(pool, model)
        for thing, remedy in (
            (pool, "share the pool object itself"),
            (lease, "use the lease object itself"),
            (handle, "wait for it and pass the value"),
            (stream, "pass the stream itself"),
        ):
            with pytest.raises(T2NErrorMisuse, match="cannot be copied or pickled") as raised:
                copier(thing)
            assert remedy in str(raised.value)
        with lease as value:
            assert torch.equal(value, torch.ones(8))
        stream.close()
    assert pool.closed, "the lease ended once: close() found nothing held"


def test_an_offload_dir_that_is_no_path_or_empty_and_a_dtype_no_file_stores_are_named(
    tmp_path: Path,
) -> None:
    safetensors.torch.save_file({"w": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    for call in (
        lambda: OffloadedTensor.from_original_tensor(torch.ones(2), "w", offload_dir=5),
        lambda: OffloadedTensor.from_safetensors(tmp_path / "x.safetensors", "w", offload_dir=5),
    ):
        with pytest.raises(T2NErrorMisuse, match="offload_dir must be a directory's path"):
            call()  # type: ignore[arg-type]
    with pytest.raises(T2NErrorMisuse, match=r"offload_dir is an empty string.*'\.' for the"):
        OffloadedTensor.from_original_tensor(torch.ones(2), "w", offload_dir="")  # (not cwd)
    weight = OffloadedTensor.from_original_tensor(torch.ones(2), "w", offload_dir=tmp_path)
    with pytest.raises(T2NErrorMisuse, match=r"torch\.quint8 cannot be stored in a payload file"):
        weight.to(torch.quint8)
    assert weight.dtype == torch.float32 and torch.equal(weight.reload(), torch.ones(2))


def test_updater_and_offloaded_tensor_arguments_of_the_wrong_type_are_misuse(
    tmp_path: Path,
) -> None:
    from torch_to_nnef.tensor.updater import ModTensorUpdater

    with pytest.raises(T2NErrorMisuse, match=r"takes the nn\.Module whose tensors it replaces"):
        ModTensorUpdater("not a module")  # type: ignore[arg-type]
    updater = ModTensorUpdater(nn.Linear(3, 2))
    for call in (
        lambda: updater.update_by_name(5, torch.ones(2, 3)),  # type: ignore[arg-type]
        lambda: updater.update_by_name(["weight"], torch.ones(2, 3)),  # type: ignore[arg-type]
        lambda: updater.get_by_name(None),  # type: ignore[arg-type]
        lambda: ModTensorUpdater.split_param_name(None),  # type: ignore[arg-type]
    ):
        with pytest.raises(T2NErrorMisuse, match="a tensor name must be a dotted str"):
            call()
    assert updater.get_by_name("weight").shape == (2, 3)
    with pytest.raises(T2NErrorMisuse, match="must be the tensor to offload, or None"):
        OffloadedTensor("values", "cpu", tmp_path, "w", torch.Tensor)  # type: ignore[arg-type]
