"""This package against the recorded public API of upstream torch-to-nnef's tensor package.

``tests/data/upstream_tensor_api.json`` is written by ``scripts/upstream_api_snapshot.py``
run in a scratch environment holding upstream's wheel (``make api-snapshot
UPSTREAM_PYTHON=...``). Every name it records must exist here, with the same kind, bases and
parameters, so that code written for upstream runs unchanged; each exception is listed below
with its reason.

Parameters are compared for call compatibility: every call upstream accepts is accepted here
with the same meaning (same names, same positions, same defaults); this package may add
parameters that have defaults.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SNAPSHOT = Path(__file__).parent / "data" / "upstream_tensor_api.json"

# Names that only make sense inside upstream's NNEF exporter (its tracing, its IR, its
# logging), each with the reason. They are not part of this package.
EXPORTER_ONLY: dict[str, str] = {
    "torch_to_nnef.tensor.opaque.NEW_OPAQUE_TRACING_STRATEGY": "switch between two tracing "
    "strategies of the exporter; this package has one",
    "torch_to_nnef.tensor.opaque.maybe_custom_op": "the exporter's wrapper choosing a tracing "
    "strategy by torch version",
    "torch_to_nnef.tensor.opaque.trace_tensor_device_for_func": "the exporter's table of ops "
    "traced on meta tensors",
    "torch_to_nnef.tensor.named.find_fake_mode": "fake-tensor plumbing of the exporter's trace",
    "torch_to_nnef.tensor.quant.base.QTENSOR_UNSUPPORTED": "torch < 1.12 support flag",
    "torch_to_nnef.tensor.quant.base.QTENSOR_UNSUPPORTED_MSG": "torch < 1.12 support message",
    "torch_to_nnef.tensor.offload.TDEVICE": "a typing alias",
    "torch_to_nnef.tensor.offload.maybe_extract_target_device": "an internal of the HF "
    "loading helpers (device-map parsing)",
}
# Module loggers are named after their module here too, but they are not API.
LOGGERS = "LOGGER"

# Deliberate differences in a member's signature, each with the reason; the member exists.
DIFFERENT_SIGNATURE: dict[str, str] = {
    "torch_to_nnef.tensor.named.NamedTensor.requires_grad_": "a NamedTensor here can require "
    "gradients, so requires_grad_ keeps torch's meaning (requires_grad=True by default) "
    "where upstream ignores it",
    "torch_to_nnef.tensor.residency.TensorPrefetch.__init__": "a prefetch handle is made by "
    "the pool (pool.prefetch, pool.pin), never by user code",
}

# Names that a module may provide lazily; each is checked like any other once it resolves.
# The Hugging Face helpers of tensor.offload (torch_to_nnef.tensor.hf) all resolve now.
PENDING: set[str] = set()

# Bases that carry no behaviour a caller relies on.
IGNORED_BASES = {"abc.ABC", "builtins.object"}


def load_snapshot() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SNAPSHOT.read_text())
    return data


def recorded_names() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for module, names in load_snapshot()["modules"].items():
        for name, fact in names.items():
            yield module, name, fact


def resolve(dotted: str) -> Any:
    """Import ``pkg.module.Name`` (or ``pkg.module.Class.member``)."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            value = getattr(value, attribute)
        return value
    raise ImportError(dotted)


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_parameters(
    where: str, upstream: list[dict[str, Any]], ours: Any, drop_first: bool
) -> list[str]:
    """Problems making a call that upstream accepts fail or change meaning here."""
    try:
        params = list(inspect.signature(ours).parameters.values())
    except ValueError:  # a method torch implements in C, accepting torch's own arguments
        return []
    if drop_first:
        params = params[1:]
    by_name = {p.name: p for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    problems = []
    index = 0
    for param in upstream:
        kind, name, default = param["kind"], param["name"], param["default"]
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            continue
        if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
            if index < len(positional):
                if kind == "POSITIONAL_OR_KEYWORD" and positional[index].name != name:
                    problems.append(
                        f"{where}: positional parameter {index} is {name!r} upstream, "
                        f"{positional[index].name!r} here"
                    )
            elif not var_positional:
                problems.append(f"{where}: takes no positional parameter {index} ({name!r})")
            index += 1
        if kind in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY"):
            mine = by_name.get(name)
            if mine is None or mine.kind is mine.POSITIONAL_ONLY:
                if not var_keyword:
                    problems.append(f"{where}: no keyword parameter {name!r}")
                continue
            if default is not None:
                if mine.default is inspect.Parameter.empty:
                    problems.append(f"{where}: {name!r} has default {default} upstream, none here")
                elif describe_default(mine.default) != default:
                    problems.append(
                        f"{where}: {name!r} defaults to {default} upstream, "
                        f"{describe_default(mine.default)} here"
                    )
    upstream_names = {p["name"] for p in upstream}
    upstream_kinds = {p["kind"] for p in upstream}
    for p in params:
        extra = p.name not in upstream_names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        # Upstream's *args / **kwargs forward such parameters: they are given there too.
        forwarded = ("VAR_POSITIONAL" in upstream_kinds and p.kind is not p.KEYWORD_ONLY) or (
            "VAR_KEYWORD" in upstream_kinds and p.kind is not p.POSITIONAL_ONLY
        )
        if extra and not forwarded and p.default is inspect.Parameter.empty:
            problems.append(f"{where}: requires {p.name!r}, which upstream does not have")
    return problems


def describe_default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def check_class(where: str, fact: dict[str, Any], ours: Any) -> list[str]:
    if not inspect.isclass(ours):
        return [f"{where}: a class upstream, a {type(ours).__name__} here"]
    problems = []
    mro = {qualified(c) for c in ours.__mro__} | {c.__name__ for c in ours.__mro__}
    for base in fact["bases"]:
        if base in IGNORED_BASES:
            continue
        # Classes of the package are compared by name (a module may differ), others exactly.
        key = base.rsplit(".", 1)[-1] if base.startswith("torch_to_nnef.") else base
        if key not in mro:
            problems.append(f"{where}: does not derive from {base}")
    for name, value in fact.get("enum_members", {}).items():
        member = ours.__members__.get(name) if isinstance(ours, enum.EnumMeta) else None
        if member is None or repr(member.value) != value:
            problems.append(f"{where}: no enum member {name} = {value}")
    for name, member in fact["members"].items():
        dotted = f"{where}.{name}"
        if dotted in EXPORTER_ONLY:
            continue
        problems.extend(check_member(dotted, member, ours, name))
    return problems


def check_member(where: str, fact: dict[str, Any], cls: type, name: str) -> list[str]:
    raw = inspect.getattr_static(cls, name, None)
    if raw is None:
        return [f"{where}: missing"]
    kind = fact["kind"]
    if kind in ("staticmethod", "classmethod"):
        if not isinstance(raw, (staticmethod, classmethod)):
            return [f"{where}: a {kind} upstream, a {type(raw).__name__} here"]
    elif kind == "function" and name not in ("__init__", "__new__"):
        if not callable(raw) or isinstance(raw, (staticmethod, classmethod)):
            return [f"{where}: a method upstream, a {type(raw).__name__} here"]
    elif kind == "property" and isinstance(raw, (staticmethod, classmethod)):
        return [f"{where}: a property upstream, a {type(raw).__name__} here"]
    if fact.get("params") is None or where in DIFFERENT_SIGNATURE:
        return []
    if name in ("__init__", "__new__"):
        return check_constructor(where, fact["params"], cls)
    if kind == "function":
        return check_parameters(where, fact["params"], raw, drop_first=True)
    return check_parameters(where, fact["params"], getattr(cls, name), drop_first=False)


def check_constructor(where: str, upstream: list[dict[str, Any]], cls: type) -> list[str]:
    """A constructor upstream (``__init__`` or ``__new__``) against the one called here."""
    init = inspect.getattr_static(cls, "__init__")
    new = inspect.getattr_static(cls, "__new__")
    candidates = []
    if where.endswith("__new__") and isinstance(new, staticmethod):
        candidates.append(new.__func__)
    candidates.append(init)
    if isinstance(new, staticmethod):
        candidates.append(new.__func__)
    results = []
    for constructor in candidates:
        try:
            problems = check_parameters(where, upstream, constructor, drop_first=True)
        except (TypeError, ValueError):
            continue
        if not problems:
            return []
        results.append(problems)
    return results[0] if results else []


def check_name(module: str, name: str, fact: dict[str, Any]) -> list[str]:
    dotted = f"{module}.{name}"
    try:
        ours = resolve(dotted)
    except (ImportError, AttributeError):
        return [f"{dotted}: missing"]
    kind = fact["kind"]
    if kind == "alias":
        target = resolve_or_none(fact["target"])
        if target is not None and target is not ours:
            return [f"{dotted}: is not {fact['target']}"]
        return []
    if kind == "class":
        return check_class(dotted, fact, ours)
    if kind == "function":
        if not callable(ours):
            return [f"{dotted}: a function upstream, a {type(ours).__name__} here"]
        return check_parameters(dotted, fact["params"], ours, drop_first=False)
    if type(ours).__name__ != fact["type"]:
        return [f"{dotted}: a {fact['type']} upstream, a {type(ours).__name__} here"]
    return []


def resolve_or_none(dotted: str) -> Any:
    try:
        return resolve(dotted)
    except (ImportError, AttributeError):
        return None


def test_snapshot_is_upstream_0_24_12() -> None:
    data = load_snapshot()
    assert data["upstream"] == "torch_to_nnef 0.24.12"
    assert "torch_to_nnef.tensor.updater" in data["modules"]


def test_every_upstream_name_exists_here_with_the_same_shape() -> None:
    problems = []
    for module, name, fact in recorded_names():
        dotted = f"{module}.{name}"
        if dotted in EXPORTER_ONLY or name == LOGGERS:
            continue
        if dotted in PENDING and resolve_or_none(dotted) is None:
            continue
        problems.extend(check_name(module, name, fact))
    assert not problems, "\n".join(problems)


def test_exclusions_name_recorded_upstream_names() -> None:
    """An exclusion that no longer matches the snapshot is stale: remove it."""
    recorded = set()
    for module, name, fact in recorded_names():
        recorded.add(f"{module}.{name}")
        recorded.update(f"{module}.{name}.{member}" for member in fact.get("members", {}))
    stale = (set(EXPORTER_ONLY) | set(DIFFERENT_SIGNATURE) | PENDING) - recorded
    assert not stale


@pytest.mark.parametrize(
    ("upstream", "ours", "problem"),
    [
        (lambda ref, new_tensor: None, lambda old, new_tensor: None, "positional parameter 0"),
        (lambda a, b=1: None, lambda a, b=2: None, "defaults to 1 upstream"),
        (lambda a, *, mode=False: None, lambda a: None, "no keyword parameter 'mode'"),
        (lambda a: None, lambda a, b: None, "requires 'b'"),
    ],
)
def test_the_comparison_catches_incompatible_signatures(
    upstream: Any, ours: Any, problem: str
) -> None:
    recorded = [
        {
            "name": p.name,
            "kind": p.kind.name,
            "default": None if p.default is p.empty else repr(p.default),
        }
        for p in inspect.signature(upstream).parameters.values()
    ]
    problems = check_parameters("f", recorded, ours, drop_first=False)
    assert any(problem in text for text in problems), problems
