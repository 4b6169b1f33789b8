"""Griffe extension used by the API reference (mkdocstrings, see ``mkdocs.yml``).

It adjusts what griffe read from the source before the pages are rendered; the code is not
changed:

- Sphinx roles in docstrings (``:class:`~torch_to_nnef.exceptions.T2NError```,
  ``:meth:`TensorResidencyPool.scope```) become autorefs cross-references to the page that
  documents the target, or plain code when no page documents it (an external or private
  name), so that the strict build has no broken reference.
- reStructuredText literal-block markers (a paragraph ending in ``::``, or a ``::`` line)
  become plain colons: the indented block that follows renders as code in Markdown already.
- A tensor subclass built by ``__new__``, whose ``__init__`` only takes ``*args, **kwargs``,
  is shown with the signature of ``__new__``, the one its docstring documents.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

DOCUMENTED_MODULES = (
    "torch_to_nnef.exceptions",
    "torch_to_nnef.tensor.checkpoint",
    "torch_to_nnef.tensor.named",
    "torch_to_nnef.tensor.offload",
    "torch_to_nnef.tensor.opaque",
    "torch_to_nnef.tensor.quant",
    "torch_to_nnef.tensor.residency",
    "torch_to_nnef.tensor.storage",
    "torch_to_nnef.tensor.updater",
    "torch_to_nnef.tensor.utils",
)
"""The modules rendered with their members by ``docs/api/``: the objects they export, and the
public members of those, are the cross-reference targets."""

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|data|mod|exc|obj|const):`(?P<target>[^`]+)`")
_LITERAL_MARK = re.compile(r"(?m)^[ \t]*::[ \t]*\n|(?<=\S)::[ \t]*$")
_FORWARDING = {griffe.ParameterKind.var_positional, griffe.ParameterKind.var_keyword}


def _canonical_path(obj: griffe.Object | griffe.Alias) -> str:
    """The path where ``obj`` is defined (an alias is followed to its target)."""
    return obj.final_target.canonical_path if isinstance(obj, griffe.Alias) else obj.canonical_path


def _exported(module: griffe.Object | griffe.Alias) -> list[str]:
    """The names ``module`` exports: its ``__all__``, else its public members."""
    names = module.exports
    if names is None:
        return [name for name in module.members if not name.startswith("_")]
    return [name if isinstance(name, str) else name.name for name in names]


def documented_paths(collection: griffe.ModulesCollection) -> dict[str, str]:
    """Map the canonical path of each documented object to the path its page renders it at."""
    documented: dict[str, str] = {}
    for module_path in DOCUMENTED_MODULES:
        module = collection[module_path]
        documented.setdefault(_canonical_path(module), module_path)
        for name in _exported(module):
            member = module.members.get(name)
            if member is None:
                continue
            try:
                target = member.final_target if isinstance(member, griffe.Alias) else member
            except griffe.AliasResolutionError:
                continue  # an external name re-exported: nothing of ours to link to
            shown = f"{module_path}.{name}"
            documented.setdefault(target.canonical_path, shown)
            if not isinstance(target, griffe.Class):
                continue
            for child_name, child in target.all_members.items():
                if child_name.startswith("_"):
                    continue
                try:
                    canonical = _canonical_path(child)
                except griffe.AliasResolutionError:
                    continue
                documented.setdefault(canonical, f"{shown}.{child_name}")
                documented.setdefault(
                    f"{target.canonical_path}.{child_name}", f"{shown}.{child_name}"
                )
    return documented


def _objects(root: griffe.Object) -> list[griffe.Object]:
    """``root`` and every object defined under it (aliases excluded)."""
    found: list[griffe.Object] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        found.append(obj)
        stack.extend(m for m in obj.members.values() if not isinstance(m, griffe.Alias))
    return found


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The canonical path ``target`` names from ``obj``'s scope (then its parents'), or None."""
    head, _, rest = target.partition(".")
    scope: griffe.Object | None = obj
    resolved: str | None = None
    while scope is not None and resolved is None:
        try:
            resolved = scope.resolve(head)
        except (griffe.NameResolutionError, griffe.AliasResolutionError):
            scope = scope.parent
    if resolved is None:
        if not target.startswith("torch_to_nnef."):
            return None
        resolved, rest = target, ""
    try:
        return _canonical_path(obj.modules_collection[f"{resolved}.{rest}" if rest else resolved])
    except (KeyError, griffe.AliasResolutionError):
        return None


def rewrite_docstring(obj: griffe.Object, text: str, documented: dict[str, str]) -> str:
    """``text`` (the docstring of ``obj``) with roles and literal-block markers rewritten."""

    def reference(match: re.Match[str]) -> str:
        written = match["target"]
        target = written.lstrip("~!")
        code = f"`{target.rsplit('.', 1)[-1] if written.startswith('~') else target}`"
        canonical = _resolve(obj, target)
        if canonical is None or canonical not in documented:
            return code
        return f"[{code}][{documented[canonical]}]"

    text = _LITERAL_MARK.sub(lambda match: "" if match[0].endswith("\n") else ":", text)
    return _ROLE.sub(reference, text)


def show_constructor_of_new(cls: griffe.Class) -> None:
    """Give a forwarding ``__init__`` the parameters of ``__new__``."""
    init = cls.members.get("__init__")
    new = cls.members.get("__new__")
    if not isinstance(init, griffe.Function) or not isinstance(new, griffe.Function):
        return
    own = list(init.parameters)
    if {p.kind for p in own[1:]} <= _FORWARDING and len(new.parameters) > 1:
        init.parameters = griffe.Parameters(own[0], *list(new.parameters)[1:])


class SphinxRolesToAutorefs(griffe.Extension):
    """Rewrite the docstrings and constructor signatures of ``torch_to_nnef`` once loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Adjust every object of the package (see the module docstring)."""
        if pkg.name != "torch_to_nnef":
            return
        documented = documented_paths(loader.modules_collection)
        for obj in _objects(pkg):
            if isinstance(obj, griffe.Class):
                show_constructor_of_new(obj)
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = rewrite_docstring(obj, obj.docstring.value, documented)
