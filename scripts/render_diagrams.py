"""Render the documentation's diagrams (``docs/assets/diagrams/*.mmd``) to SVG files beside them.

The site shows the SVG files, so diagrams display without network and without a script.
Rendering needs a mermaid bundle and a headless Chromium, neither of which the site or the
tests need::

    npm pack mermaid@11 && tar xzf mermaid-11.*.tgz     # gives package/dist/mermaid.min.js
    python scripts/render_diagrams.py package/dist/mermaid.min.js

Edit the ``.mmd`` source, run the command, commit both files.
"""

from __future__ import annotations

import argparse
import html
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DIAGRAMS = Path(__file__).resolve().parents[1] / "docs" / "assets" / "diagrams"

PAGE = """<!doctype html><html><head><meta charset="utf-8">
<script src="mermaid.min.js"></script></head><body>
<pre id="source">{source}</pre><div id="svg"></div>
<script>
mermaid.initialize({{startOnLoad: false, theme: "neutral", securityLevel: "strict",
                     htmlLabels: false}});
mermaid.render("diagram", document.getElementById("source").textContent)
  .then(result => {{ document.getElementById("svg").textContent = result.svg; }});
</script></body></html>
"""


def render(source: Path, mermaid_js: Path, chromium: str) -> str:
    """The SVG text mermaid makes of ``source``, rendered in headless Chromium."""
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copy(mermaid_js, Path(scratch) / "mermaid.min.js")
        page = Path(scratch) / "page.html"
        page.write_text(PAGE.format(source=html.escape(source.read_text())), encoding="utf-8")
        dom = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu",
             "--virtual-time-budget=10000", "--allow-file-access-from-files",
             "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip
    found = re.search(r'<div id="svg">(&lt;svg.*?)</div>', dom, re.S)
    if found is None:
        raise SystemExit(f"{source.name}: mermaid produced no SVG (a syntax error?)")
    return html.unescape(found[1]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mermaid_js", type=Path, help="path of mermaid.min.js (mermaid 11)")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    for source in sorted(DIAGRAMS.glob("*.mmd")):
        target = source.with_suffix(".svg")
        target.write_text(render(source, args.mermaid_js, args.chromium), encoding="utf-8")
        print(f"wrote {target.relative_to(DIAGRAMS.parents[2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
