"""The documentation site: docstrings of every public name, the strict build, runnable guides.

Code blocks of the pages (API reference excepted) are executed page by page. The convention:

- a fence opened with ```` ```python ```` (optionally with a ``title="..."``) is runnable: the
  runnable blocks of one page are run in order, as one script, in a fresh temporary directory;
- a fence opened with ```` ```{.python .no-run} ```` is shown but not run (code needing a GPU,
  fragments);
- other languages (``text``, ``sh``, ``mermaid``) are never run.
"""

from __future__ import annotations

import enum
import html
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

PUBLIC_MODULES = [
    "torch_to_nnef.exceptions",
    "torch_to_nnef.tensor",
    "torch_to_nnef.tensor.checkpoint",
    "torch_to_nnef.tensor.named",
    "torch_to_nnef.tensor.offload",
    "torch_to_nnef.tensor.opaque",
    "torch_to_nnef.tensor.quant",
    "torch_to_nnef.tensor.residency",
    "torch_to_nnef.tensor.sizing",
    "torch_to_nnef.tensor.storage",
    "torch_to_nnef.tensor.updater",
    "torch_to_nnef.tensor.utils",
]
"""Modules with a page in the API reference (``docs/api/``)."""

NOT_CONSTRUCTED_BY_USERS = "not constructed directly"
"""Phrase by which a class docstring says that the library builds its instances (a handle
returned by a method): its constructor parameters need not be documented."""


# ---------------------------------------------------------------------------------------------
# Docstrings
# ---------------------------------------------------------------------------------------------
def _public_objects() -> Iterator[tuple[str, Any]]:
    """``(qualified name, object)`` for every exported name of every public module."""
    seen: set[int] = set()
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if id(value) in seen or isinstance(value, (int, str, float)):
                continue  # constants are documented by attribute docstrings (checked below)
            seen.add(id(value))
            yield f"{module_name}.{name}", value


def _own_members(cls: type) -> Iterator[tuple[str, Any, Any]]:
    """``(name, raw attribute, function or property)`` of the public methods/properties."""
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        member = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        if inspect.isfunction(member) or isinstance(member, property):
            yield name, raw, member


def _documented_parameters(function: Any, skip_first: bool) -> list[str]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    names = [
        p.name
        for p in signature.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return names[1:] if skip_first else names


_ENTRY_SECTIONS = frozenset({"parameters", "other parameters", "attributes"})


def documented_names(docstring: str | None) -> set[str]:
    """The parameters a Google-style docstring documents, as the API reference renders them.

    With an ``Args:`` (or ``Attributes:``) block: its entries, parsed by griffe as mkdocstrings
    parses them, so that a mis-indented entry (which ends the block and renders as a stray
    paragraph) does not count. Without one (a short docstring): the names it quotes as
    ````name````.
    """
    import griffe

    text = inspect.cleandoc(docstring or "")
    sections = griffe.Docstring(text, lineno=1).parse(
        "google", warn_unknown_params=False, warn_missing_types=False
    )
    blocks = [section for section in sections if section.kind.value in _ENTRY_SECTIONS]
    if not blocks:
        return set(re.findall(r"``(\w+)``", text))
    return {entry.name for block in blocks for entry in block.value}


def undocumented_parameters(function: Any, *docstrings: str | None, skip_first: bool) -> list[str]:
    """Parameters of ``function`` (``*args``/``**kwargs`` aside) that ``docstrings`` (by
    default the function's own) do not document (see :func:`documented_names`)."""
    documented: set[str] = set()
    for docstring in docstrings or (function.__doc__,):
        documented |= documented_names(docstring)
    return [p for p in _documented_parameters(function, skip_first) if p not in documented]


def _constructor(cls: type) -> Any:
    """The method whose parameters a class docstring documents (``__new__`` or ``__init__``)."""
    for name in ("__init__", "__new__"):
        raw = cls.__dict__.get(name)
        member = raw.__func__ if isinstance(raw, staticmethod) else raw
        if inspect.isfunction(member):
            params = _documented_parameters(member, skip_first=True)
            if params:
                return member
    return None


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_module_has_a_docstring_and_an_all(module_name: str) -> None:
    module: ModuleType = importlib.import_module(module_name)
    assert inspect.getdoc(module), f"{module_name} has no docstring"
    assert isinstance(module.__all__, list) and module.__all__, f"{module_name} has no __all__"
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.__all__ names {name!r}, which is missing"


def test_every_public_name_method_and_property_has_a_docstring() -> None:
    missing = []
    for qualified, value in _public_objects():
        own = value.__dict__.get("__doc__") if inspect.isclass(value) else value.__doc__
        if not (own or "").strip():
            missing.append(qualified)
        if inspect.isclass(value):
            for name, _, member in _own_members(value):
                if not (member.__doc__ or "").strip():
                    missing.append(f"{qualified}.{name}")
    assert not missing, f"public names without a docstring: {missing}"


def test_every_exported_constant_has_a_docstring() -> None:
    """Constants have no ``__doc__`` of their own: read their attribute docstrings with griffe."""
    griffe = pytest.importorskip("griffe")
    package = griffe.load("torch_to_nnef", search_paths=[str(ROOT / "src")])
    missing = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if not isinstance(getattr(module, name), (int, str, float)):
                continue
            member = package[module_name.removeprefix("torch_to_nnef.")].members[name]
            target = member.final_target if member.is_alias else member
            if target.docstring is None or not target.docstring.value.strip():
                missing.append(f"{module_name}.{name}")
    assert not missing, f"constants without a docstring: {missing}"


PENDING_ARGS_FIXES: dict[str, str] = {}
"""Known defects awaiting a fix in their module; each must still be a defect (checked)."""


def _parameter_defects() -> dict[str, list[str]]:
    """``{qualified name: undocumented parameters}`` over every public function and method."""
    defects: dict[str, list[str]] = {}
    for qualified, value in _public_objects():
        if inspect.isfunction(value):
            defects[qualified] = undocumented_parameters(value, skip_first=False)
            continue
        if not inspect.isclass(value) or issubclass(value, (BaseException, enum.Enum, tuple)):
            continue
        class_doc = value.__dict__.get("__doc__") or ""
        constructor = _constructor(value)
        if constructor is not None and NOT_CONSTRUCTED_BY_USERS not in class_doc:
            defects[qualified] = undocumented_parameters(
                constructor, class_doc, constructor.__doc__, skip_first=True
            )
        for method_name, raw, member in _own_members(value):
            if not isinstance(member, property):
                defects[f"{qualified}.{method_name}"] = undocumented_parameters(
                    member, skip_first=not isinstance(raw, staticmethod)
                )
    return {name: missing for name, missing in defects.items() if missing}


def test_every_parameter_is_documented() -> None:
    """Each parameter of a public function, method or constructor is an entry of its ``Args:``
    block (or, in a docstring without one, is quoted), as the API reference renders it."""
    defects = _parameter_defects()
    unexpected = {k: v for k, v in defects.items() if k not in PENDING_ARGS_FIXES}
    assert not unexpected, f"parameters missing from their Args block: {unexpected}"
    fixed = sorted(set(PENDING_ARGS_FIXES) - set(defects))
    assert not fixed, f"fixed: remove them from PENDING_ARGS_FIXES: {fixed}"


def test_the_parameter_check_catches_docstring_defects() -> None:
    """The check above fails on a mis-indented, a missing and a misspelt entry, and on a
    short docstring that never names its parameter; it passes a complete docstring."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        fixtures = importlib.import_module("fixtures.docstring_defects")
    finally:
        sys.path.remove(str(ROOT / "tests"))

    def check(function: Any) -> list[str]:
        return undocumented_parameters(function, skip_first=False)

    assert check(fixtures.misindented) == ["device", "mode"]
    assert check(fixtures.missing) == ["device"]
    assert check(fixtures.misspelt) == ["device"]
    assert check(fixtures.unnamed) == ["source"]
    assert check(fixtures.short) == [] and check(fixtures.documented) == []


def test_every_exported_name_is_listed_on_the_package_page() -> None:
    tensor = importlib.import_module("torch_to_nnef.tensor")
    page = (DOCS / "api" / "tensor.md").read_text(encoding="utf-8")
    missing = [name for name in tensor.__all__ if f"| `{name}` |" not in page]
    assert not missing, f"docs/api/tensor.md does not list {missing}"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_module_has_a_reference_page(module_name: str) -> None:
    pages = "\n".join(p.read_text(encoding="utf-8") for p in (DOCS / "api").glob("*.md"))
    assert re.search(rf"^::: {re.escape(module_name)}$", pages, re.MULTILINE), (
        f"no page of docs/api/ renders {module_name}"
    )


def test_explicit_member_lists_cover_all_exports() -> None:
    """A reference page that lists members (to order them) lists every exported name."""
    for page in (DOCS / "api").glob("*.md"):
        text = page.read_text(encoding="utf-8")
        rendered = re.search(r"^::: ([\w.]+)$", text, re.MULTILINE)
        listed = re.findall(r"^ {8}- (\w+)$", text, re.MULTILINE)
        if rendered is None or not listed:
            continue
        exported = importlib.import_module(rendered[1]).__all__
        assert sorted(listed) == sorted(exported), (
            f"{page.relative_to(ROOT)} lists {sorted(listed)}; {rendered[1]} exports "
            f"{sorted(exported)}"
        )


def test_architecture_page_names_every_module() -> None:
    """The module table of docs/architecture.md lists every module, and only existing ones."""
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", page, re.MULTILINE))
    package = ROOT / "src" / "torch_to_nnef"
    existing = set()
    for path in package.rglob("*.py"):
        relative = path.relative_to(package).as_posix()
        existing.add(relative if "/" in relative else f"torch_to_nnef/{relative}")
    stale = sorted(listed - existing)
    absent = sorted(m for m in existing - listed if not m.endswith("__init__.py"))
    assert not stale, f"docs/architecture.md lists modules that do not exist: {stale}"
    assert not absent, f"docs/architecture.md does not say where these modules sit: {absent}"


# ---------------------------------------------------------------------------------------------
# The strict build
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_strict_build_succeeds(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_environment(), "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    assert (site / "index.html").is_file()
    reference = (site / "api" / "residency" / "index.html").read_text(encoding="utf-8")
    assert 'id="torch_to_nnef.tensor.residency.TensorResidencyPool.acquire"' in reference
    assert ":class:`" not in reference and ":meth:`" not in reference
    # Diagrams render offline and without a script: the page shows an SVG drawn from the
    # mermaid source beside it, and that drawing still carries every line of its source.
    architecture = (site / "architecture" / "index.html").read_text(encoding="utf-8")
    assert '<img alt="The message flow' in architecture
    assert 'src="../assets/diagrams/message-flow.svg"' in architecture
    drawing = (site / "assets" / "diagrams" / "message-flow.svg").read_text(encoding="utf-8")
    assert drawing.startswith("<svg") and "<script" not in drawing
    source = (DOCS / "assets" / "diagrams" / "message-flow.mmd").read_text(encoding="utf-8")
    text = html.unescape(re.sub(r"<[^>]+>", "\n", drawing))
    for label in re.findall(r"(?:participant \w+ as |: )(.+)", source):
        assert label.strip() in text, f"the SVG misses {label!r}: redraw it"


def _bench_hook(results: Path) -> ModuleType:
    """A fresh copy of docs/hooks/bench_results.py reading its files from ``results``."""
    spec = importlib.util.spec_from_file_location(
        "bench_results_hook", DOCS / "hooks" / "bench_results.py"
    )
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    hook.SUMMARY = results / "summary.md"
    hook.TIMELINE = results / "timeline.png"
    hook.GPU_CHECK = results / "gpu_check.md"
    return hook


@dataclass
class _PageFile:
    src_uri: str


@dataclass
class _Page:
    file: _PageFile


def test_benchmark_marks_without_results(tmp_path: Path) -> None:
    hook = _bench_hook(tmp_path)
    page = _Page(_PageFile("performance.md"))
    text = "<!-- bench:summary -->\n<!-- bench:timeline -->\n<!-- bench:summary:collapsed -->"
    out = hook.on_page_markdown(text, page, config=None, files=None)
    assert "<!--" not in out
    assert out.count("make bench") == 3  # each mark says how to produce its figures
    gpu = hook.on_page_markdown("<!-- bench:gpu -->", page, config=None, files=None)
    assert "<!--" not in gpu and "gpu_check.py --markdown" in gpu


def test_benchmark_marks_with_results(tmp_path: Path) -> None:
    (tmp_path / "summary.md").write_text("# Results\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    (tmp_path / "timeline.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    hook = _bench_hook(tmp_path)
    guide = _Page(_PageFile("guides/strategies.md"))
    out = hook.on_page_markdown(
        "<!-- bench:summary -->\n<!-- bench:timeline -->", guide, config=None, files=None
    )
    assert "### Results" in out and "| 1 | 2 |" in out  # headings nest under the page's
    assert "](../assets/bench/timeline.png)" in out
    collapsed = hook.on_page_markdown("<!-- bench:summary:collapsed -->", guide, None, None)
    assert collapsed.startswith("??? info") and "    | 1 | 2 |" in collapsed
    (tmp_path / "gpu_check.md").write_text("# GPU check\n\n| CUDA tests | 9 passed |\n")
    gpu = hook.on_page_markdown("<!-- bench:gpu -->", guide, None, None)
    assert gpu.startswith("### GPU check") and "| CUDA tests | 9 passed |" in gpu


# ---------------------------------------------------------------------------------------------
# Runnable code blocks of the guides
# ---------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_RUNNABLE = re.compile(r'^python(?:\s+title="[^"]*")?\s*$')
_SHOWN_ONLY = re.compile(r"^\{\s*\.python\s+\.no-run\s*\}\s*$")
_OTHER = re.compile(r"^(?:text|sh|console|mermaid|json|toml|yaml)\s*$")


@dataclass(frozen=True)
class CodeBlock:
    """A fenced block of a page: where it starts, its info string and its code."""

    page: Path
    line: int
    info: str
    code: str

    @property
    def runnable(self) -> bool:
        return _RUNNABLE.match(self.info) is not None


def code_blocks(page: Path) -> list[CodeBlock]:
    """The fenced code blocks of a Markdown page, in order (indented fences included)."""
    blocks: list[CodeBlock] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opener = _FENCE.match(lines[index])
        if opener is None:
            index += 1
            continue
        indent, fence, info = opener["indent"], opener["fence"], opener["info"].strip()
        body: list[str] = []
        end = index + 1
        while end < len(lines) and lines[end].strip() != fence:
            body.append(lines[end][len(indent) :] if lines[end].startswith(indent) else lines[end])
            end += 1
        blocks.append(CodeBlock(page, index + 1, info, "\n".join(body) + "\n"))
        index = end + 1
    return blocks


def pages_with_code() -> list[Path]:
    """README.md and the pages of the site (the API reference aside)."""
    pages = sorted(p for p in DOCS.rglob("*.md") if "api" not in p.relative_to(DOCS).parts)
    return [ROOT / "README.md", *pages]


def test_fences_follow_the_convention() -> None:
    """A misspelt info string would silently turn a block into plain text, or skip a test."""
    wrong = [
        f"{block.page.relative_to(ROOT)}:{block.line}: ```{block.info}"
        for page in pages_with_code()
        for block in code_blocks(page)
        if not (
            _RUNNABLE.match(block.info) or _SHOWN_ONLY.match(block.info) or _OTHER.match(block.info)
        )
    ]
    assert not wrong, (
        'fences must open with ```python, ```python title="...", ```{.python .no-run} or a '
        f"non-Python language: {wrong}"
    )


def test_code_blocks_fit_the_page() -> None:
    """Lines of code blocks stay within 80 characters on the site's pages: what a code block
    shows without scrolling (Material's content column, at any window width from 1220 pixels,
    measured in a browser), and within 88 in README.md. Diagrams are not code."""
    long_lines = [
        f"{block.page.relative_to(ROOT)}:{block.line + number}"
        for page in pages_with_code()
        for block in code_blocks(page)
        if block.info != "mermaid"
        for number, line in enumerate(block.code.splitlines(), start=1)
        if len(line) > (88 if page.name == "README.md" else 80)
    ]
    assert not long_lines, f"code lines wider than the page: {long_lines}"


def test_code_block_extraction() -> None:
    page = DOCS / "guides" / "quickstart.md"
    blocks = code_blocks(page)
    assert blocks and all(block.runnable for block in blocks)
    assert blocks[0].code.startswith("import os\n")
    shown_only = CodeBlock(page, 1, "{.python .no-run}", "")
    assert not shown_only.runnable and _SHOWN_ONLY.match(shown_only.info)


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}


def _script(page: Path) -> str:
    parts = []
    for block in code_blocks(page):
        if block.runnable:
            parts.append(
                f"# --- {page.relative_to(ROOT)}, block at line {block.line}\n{block.code}"
            )
    return "\n".join(parts)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "page",
    [p for p in pages_with_code() if any(b.runnable for b in code_blocks(p))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_runnable_blocks_of_the_page_run(page: Path, tmp_path: Path) -> None:
    script = tmp_path / "page.py"
    script.write_text(_script(page), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_environment(),
    )
    assert result.returncode == 0, (
        f"the code of {page.relative_to(ROOT)} failed (the script is {script}):\n"
        f"{result.stderr[-6000:]}"
    )
