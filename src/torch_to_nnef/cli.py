"""The ``t2n-residency`` command.

``t2n-residency inspect CHECKPOINT`` describes a checkpoint before a model is bound to it: its
format (safetensors, read in place, or pickle), its tensors by dtype, its total and largest
tensor, which are what a pool's budget is sized from. The demo of the project (``make demo``)
lives in ``benchmarks/demo.py``, outside the package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from torch_to_nnef import __version__
from torch_to_nnef.exceptions import T2NError

__all__ = ["main"]

_PROG = "t2n-residency"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Tools around torch_to_nnef's tensor residency pool.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="describe a checkpoint: format, tensors by dtype, total and largest tensor",
        description=(
            "Describe a checkpoint (a .safetensors file, a sharded checkpoint's index, or a "
            "directory holding one) without reading its tensors."
        ),
    )
    inspect.add_argument("checkpoint", type=Path, help="file, index or directory")
    return parser


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _inspect(path: Path) -> int:
    from torch_to_nnef.tensor.checkpoint import describe_checkpoint

    description = describe_checkpoint(path)
    print(f"{description.source}: {description.kind}")
    for dtype, (count, nbytes) in sorted(description.by_dtype.items(), key=lambda i: -i[1][1]):
        print(f"  {dtype}: {count} tensor(s), {_size(nbytes)}")
    print(f"total: {description.tensors} tensor(s), {_size(description.nbytes)}")
    key, nbytes = description.largest
    print(f"largest tensor: {key!r}, {_size(nbytes)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``t2n-residency`` with ``argv`` (``sys.argv[1:]`` when ``None``).

    Returns:
        the exit status: 0 on success, 2 for a usage error or a checkpoint that cannot be read.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _inspect(args.checkpoint)
    except T2NError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
