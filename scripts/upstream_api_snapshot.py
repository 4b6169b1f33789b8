"""Record the public API of upstream torch-to-nnef's ``torch_to_nnef.tensor`` package as JSON.

Run it with a Python that has upstream torch-to-nnef installed (a scratch environment, never
this project's): ``make api-snapshot UPSTREAM_PYTHON=/tmp/scratch/bin/python``. It records
facts only, for ``tests/test_upstream_api.py`` to compare this project against:

- for each module of the package, the public names it defines (top-level ``def``, ``class``
  and assignments of its source; for a package, its ``__all__``, each an alias of the
  module-level name it re-exports);
- for a function, its parameters (name, kind, default); for a class, its bases, its enum
  members, and the public members its own body defines (kind and parameters);
- for ``torch_to_nnef.exceptions``, the exception classes the package uses and their bases.

Nothing from this project is imported: the script must not run where ``torch_to_nnef`` is
this project (it refuses when the installed distribution is not upstream's).
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import importlib.metadata
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any

MODULES = [
    "torch_to_nnef.tensor",
    "torch_to_nnef.tensor.named",
    "torch_to_nnef.tensor.offload",
    "torch_to_nnef.tensor.opaque",
    "torch_to_nnef.tensor.quant",
    "torch_to_nnef.tensor.quant.base",
    "torch_to_nnef.tensor.quant.qtract",
    "torch_to_nnef.tensor.residency",
    "torch_to_nnef.tensor.updater",
    "torch_to_nnef.tensor.utils",
]
EXCEPTIONS = "torch_to_nnef.exceptions"
DISTRIBUTION = "torch_to_nnef"


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def describe_default(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def parameters(func: Any, drop_first: bool) -> list[dict[str, Any]] | None:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    params = list(signature.parameters.values())
    if drop_first and params:
        params = params[1:]
    return [
        {"name": p.name, "kind": p.kind.name, "default": describe_default(p.default)}
        for p in params
    ]


def describe_member(cls: type, name: str, raw: Any) -> dict[str, Any]:
    if isinstance(raw, staticmethod):  # __new__ is one, with ``cls`` first
        params = parameters(getattr(cls, name), name == "__new__")
        return {"kind": "staticmethod", "params": params}
    if isinstance(raw, classmethod):
        return {"kind": "classmethod", "params": parameters(getattr(cls, name), False)}
    if isinstance(raw, property):
        return {"kind": "property", "settable": raw.fset is not None}
    if isinstance(raw, types.FunctionType):
        return {"kind": "function", "params": parameters(raw, True)}
    return {"kind": "attribute"}


def describe_class(cls: type) -> dict[str, Any]:
    members: dict[str, Any] = {}
    for name, raw in vars(cls).items():
        public = not name.startswith("_") or name in ("__init__", "__new__")
        if not public or (isinstance(cls, enum.EnumMeta) and name in cls.__members__):
            continue
        members[name] = describe_member(cls, name, raw)
    described: dict[str, Any] = {
        "kind": "class",
        "bases": [qualified(base) for base in cls.__bases__],
        "members": dict(sorted(members.items())),
    }
    if isinstance(cls, enum.EnumMeta):
        described["enum_members"] = {
            name: repr(member.value) for name, member in cls.__members__.items()
        }
    return described


def describe(value: Any, module: types.ModuleType) -> dict[str, Any]:
    home = getattr(value, "__module__", None)
    if (inspect.isclass(value) or inspect.isfunction(value)) and home != module.__name__:
        return {"kind": "alias", "target": f"{home}.{value.__qualname__}"}
    if inspect.isclass(value):
        return describe_class(value)
    if inspect.isroutine(value):
        return {"kind": "function", "params": parameters(value, False)}
    return {"kind": "constant", "type": type(value).__name__}


def defined_names(module: types.ModuleType) -> list[str]:
    """Public names the module's own source defines at top level (or its ``__all__``)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    tree = ast.parse(inspect.getsource(module))
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.extend(t.id for t in targets if isinstance(t, ast.Name))
    return [name for name in dict.fromkeys(names) if not name.startswith("_")]


def exception_classes(modules: list[types.ModuleType]) -> dict[str, Any]:
    """The classes of ``torch_to_nnef.exceptions`` the modules use, with their T2N bases."""
    exceptions = importlib.import_module(EXCEPTIONS)
    base = exceptions.T2NError
    found: dict[str, type] = {}
    pending = [
        value
        for module in modules
        for value in vars(module).values()
        if inspect.isclass(value) and issubclass(value, base)
    ]
    for module in modules:  # classes raised through the module namespace (`exceptions.X`)
        source = inspect.getsource(module)
        pending.extend(
            cls
            for name, cls in vars(exceptions).items()
            if inspect.isclass(cls) and issubclass(cls, base) and name in source
        )
    while pending:
        cls = pending.pop()
        if cls.__name__ in found:
            continue
        found[cls.__name__] = cls
        pending.extend(b for b in cls.__bases__ if issubclass(b, base))
    return {
        name: {"kind": "class", "bases": [qualified(b) for b in cls.__bases__], "members": {}}
        for name, cls in sorted(found.items())
    }


def snapshot() -> dict[str, Any]:
    version = importlib.metadata.version(DISTRIBUTION)
    modules = [importlib.import_module(name) for name in MODULES]
    import torch

    api: dict[str, Any] = {}
    for module in modules:
        api[module.__name__] = {
            name: describe(getattr(module, name), module) for name in sorted(defined_names(module))
        }
    api[EXCEPTIONS] = exception_classes(modules)
    return {
        "upstream": f"{DISTRIBUTION} {version}",
        "torch": torch.__version__.split("+")[0],
        "modules": api,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="where to write the JSON snapshot")
    args = parser.parse_args()
    try:
        importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(
            f"{sys.executable} has no upstream {DISTRIBUTION}: install its wheel there with "
            "pip install --no-deps (plus torch, numpy, nnef_tools, mako)"
        )
    data = snapshot()
    args.output.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.output}: {data['upstream']} (torch {data['torch']})")


if __name__ == "__main__":
    main()
