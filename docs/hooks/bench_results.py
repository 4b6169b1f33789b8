"""MkDocs hook: put the latest ``make bench`` results into the pages that mark a place for them.

``make bench`` writes ``benchmarks/results/summary.md`` (tables, with the machine they were
measured on) and ``benchmarks/results/timeline.png`` (the overlap of disk reads and compute);
``benchmarks/gpu_check.py --markdown``, run on a CUDA machine, writes
``benchmarks/results/gpu_check.md``. None needs to exist: a page marks where they go with an
HTML comment, and the hook puts there the file's content, or a note saying how to produce it, so
that the strict build passes before and after the first benchmark run.

- ``<!-- bench:summary -->``: the summary, as written.
- ``<!-- bench:summary:collapsed -->``: the summary in a collapsed block.
- ``<!-- bench:timeline -->``: the timeline chart; the PNG is added to the built site as
  ``assets/bench/timeline.png`` (MkDocs only serves files it knows of).
- ``<!-- bench:gpu -->``: the latest GPU check's table.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SUMMARY = RESULTS / "summary.md"
TIMELINE = RESULTS / "timeline.png"
GPU_CHECK = RESULTS / "gpu_check.md"
TIMELINE_URI = "assets/bench/timeline.png"

SUMMARY_MARK = "<!-- bench:summary -->"
COLLAPSED_MARK = "<!-- bench:summary:collapsed -->"
TIMELINE_MARK = "<!-- bench:timeline -->"
GPU_MARK = "<!-- bench:gpu -->"

_NO_SUMMARY = (
    '!!! note "No benchmark results in this build"\n'
    "    `make bench` writes `benchmarks/results/summary.md`; rebuild the site (`make docs`)\n"
    "    afterwards to show its tables here.\n"
)
_NO_TIMELINE = (
    '!!! note "No timeline chart in this build"\n'
    "    `make bench` draws `benchmarks/results/timeline.png`; rebuild the site (`make docs`)\n"
    "    afterwards to show it here.\n"
)
_NO_GPU_CHECK = (
    '!!! note "No GPU check results in this build"\n'
    "    `python benchmarks/gpu_check.py --markdown`, run on a CUDA machine, writes\n"
    "    `benchmarks/results/gpu_check.md`; rebuild the site (`make docs`) to show it here.\n"
)


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Add the timeline chart to the site when ``make bench`` produced it."""
    if TIMELINE.is_file():
        files.append(File.generated(config, TIMELINE_URI, abs_src_path=str(TIMELINE)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files, **kwargs: Any) -> str:
    """Replace the benchmark marks of ``page`` by the results (or by how to produce them)."""
    uri = page.file.src_uri
    if COLLAPSED_MARK in markdown:
        markdown = markdown.replace(COLLAPSED_MARK, _collapsed(_summary(uri)))
    if SUMMARY_MARK in markdown:
        markdown = markdown.replace(SUMMARY_MARK, _summary(uri) or _NO_SUMMARY)
    if TIMELINE_MARK in markdown:
        markdown = markdown.replace(TIMELINE_MARK, _timeline(uri))
    if GPU_MARK in markdown:
        gpu = _demote_headings(GPU_CHECK.read_text(encoding="utf-8")) if GPU_CHECK.is_file() else ""
        markdown = markdown.replace(GPU_MARK, gpu or _NO_GPU_CHECK)
    return markdown


def _summary(page_uri: str) -> str:
    if not SUMMARY.is_file():
        return ""
    text = SUMMARY.read_text(encoding="utf-8")
    # The summary links the chart next to it; on the site the chart lives in the assets.
    text = text.replace("](timeline.png)", f"]({_timeline_link(page_uri)})")
    return _demote_headings(text)


def _timeline_link(page_uri: str) -> str:
    return posixpath.relpath(TIMELINE_URI, posixpath.dirname(page_uri) or ".")


def _demote_headings(text: str) -> str:
    """Nest the summary's headings under the page's own (``#`` becomes ``###``)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced and line.startswith("#"):
            line = "##" + line
        lines.append(line)
    return "\n".join(lines) + "\n"


def _collapsed(summary: str) -> str:
    if not summary:
        return _NO_SUMMARY
    body = "\n".join(f"    {line}" if line else "" for line in summary.splitlines())
    return f'??? info "Latest `make bench` results"\n{body}\n'


def _timeline(page_uri: str) -> str:
    if not TIMELINE.is_file():
        return _NO_TIMELINE
    return f"![Disk reads overlapping compute, from make bench]({_timeline_link(page_uri)})\n"
