"""The public surface: `torch_to_nnef.tensor.__all__` and the exception tree."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import torch_to_nnef.exceptions as exceptions
from torch_to_nnef.exceptions import T2NError

PUBLIC_TENSOR_NAMES = {
    "NamedTensor",
    "OffloadedTensor",
    "apply_name_to_tensor_in_module",
    "QTensor",
    "QScalePerGroupF16",
    "QTensorTractScaleOnly",
    "OpaqueTensorRef",
    "set_opaque_tensor_in_params_as_ref",
    "TensorResidencyPool",
    "TensorResidencyLease",
    "TensorPrefetch",
    "ResidencyStrategy",
    "active_tensor_residency",
    "stream_modules",
    "offload_module",
    "load_offloaded_checkpoint",
}


def test_tensor_all_is_exactly_the_documented_names() -> None:
    tensor = importlib.import_module("torch_to_nnef.tensor")
    assert set(tensor.__all__) == PUBLIC_TENSOR_NAMES
    assert len(tensor.__all__) == len(PUBLIC_TENSOR_NAMES)


@pytest.mark.parametrize("name", sorted(PUBLIC_TENSOR_NAMES))
def test_public_name_is_importable_and_documented(name: str) -> None:
    tensor = importlib.import_module("torch_to_nnef.tensor")
    value = getattr(tensor, name)
    assert inspect.getdoc(value), f"torch_to_nnef.tensor.{name} has no docstring"


@pytest.mark.parametrize(
    "module",
    [
        "torch_to_nnef.tensor.opaque",
        "torch_to_nnef.tensor.named",
        "torch_to_nnef.tensor.updater",
        "torch_to_nnef.tensor.utils",
    ],
)
def test_foundation_modules_document_every_public_name(module: str) -> None:
    imported = importlib.import_module(module)
    assert inspect.getdoc(imported)
    for name in imported.__all__:
        value = getattr(imported, name)
        assert inspect.getdoc(value), f"{module}.{name} has no docstring"
        members = inspect.getmembers(value, inspect.isfunction) if inspect.isclass(value) else []
        for member_name, member in members:
            if member_name.startswith("_") or member.__module__ != module:
                continue
            assert member.__doc__, f"{module}.{name}.{member_name} has no docstring"


def _library_errors() -> list[type[T2NError]]:
    importlib.import_module("torch_to_nnef.tensor")  # imports every module that defines errors
    found: list[type[T2NError]] = []
    pending = [T2NError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(
            sub for sub in cls.__subclasses__() if sub.__module__.startswith("torch_to_nnef")
        )
    return found


def test_every_library_error_has_its_own_docstring() -> None:
    for cls in _library_errors():
        assert cls.__dict__.get("__doc__"), f"{cls.__module__}.{cls.__qualname__} has no docstring"


def test_exceptions_docstring_draws_the_tree() -> None:
    doc = exceptions.__doc__ or ""
    lines = doc.splitlines()
    root = [line for line in lines if re.match(r"^\s*T2NError\s", line)]
    assert root, "the tree's root line `T2NError ...` is missing"
    declared = [
        getattr(exceptions, name)
        for name in exceptions.__all__
        if isinstance(getattr(exceptions, name), type)
    ]
    for cls in declared:
        if cls is T2NError:
            continue
        pattern = rf"[├└]── {cls.__name__}\s"
        assert any(re.search(pattern, line) for line in lines), f"{cls.__name__} is not drawn"
        assert issubclass(cls, T2NError)
    assert T2NError in declared
