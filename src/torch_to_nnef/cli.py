"""The ``t2n-residency`` command.

``t2n-residency demo`` streams a synthetic model bigger than its memory budget through one
residency pool while serving concurrent requests from async code, and prints what it measured
(see :mod:`torch_to_nnef._demo`). ``t2n-residency demo --help`` lists the options.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch_to_nnef import __version__
from torch_to_nnef.exceptions import T2NError

__all__ = ["main"]

_PROG = "t2n-residency"
_STRATEGY_CHOICES = ("lru", "fixed", "scheduled", "all")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Tools around torch_to_nnef's tensor residency pool.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="serve a model bigger than its memory budget through one residency pool",
        description=(
            "Build a synthetic model, offload it, serve concurrent requests from async code "
            "through one TensorResidencyPool with a budget smaller than the model (LRU, FIXED "
            "and SCHEDULED, with and without prefetch-ahead) and print what was measured. "
            "Defaults: a 1 GB model of 24 blocks, a budget of a quarter of it, 16 requests, "
            "4 at a time."
        ),
    )
    demo.add_argument("--model-gb", type=float, help="weights of the model in GB (default 1.0)")
    demo.add_argument(
        "--budget-gb", type=float, help="the pool's budget in GB (default: a quarter of the model)"
    )
    demo.add_argument(
        "--strategy",
        choices=_STRATEGY_CHOICES,
        default="all",
        help="the retention strategy to run (default: all three)",
    )
    demo.add_argument("--device", help="where the forwards run: cpu or cuda:N (default cpu)")
    demo.add_argument("--requests", type=int, help="requests per run (default 16)")
    demo.add_argument("--concurrency", type=int, help="requests in flight at once (default 4)")
    demo.add_argument("--blocks", type=int, help="residual blocks of the model (default 24)")
    demo.add_argument("--tokens", type=int, help="rows of each request's input (default 32)")
    demo.add_argument("--depth", type=int, help="blocks prefetched ahead (default 1)")
    demo.add_argument("--seed", type=int, help="seed of the weights and inputs (default 0)")
    demo.add_argument(
        "--quick", action="store_true", help="tiny sizes that run in seconds (flags still apply)"
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def _demo(args: argparse.Namespace) -> int:
    from torch_to_nnef._demo import DemoConfig, run_demo
    from torch_to_nnef.tensor.residency import ResidencyStrategy

    config = DemoConfig.quick() if args.quick else DemoConfig()
    overrides = {
        "model_gb": args.model_gb,
        "budget_gb": args.budget_gb,
        "device": args.device,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "blocks": args.blocks,
        "tokens": args.tokens,
        "depth": args.depth,
        "seed": args.seed,
    }
    changes: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    if args.strategy != "all":
        changes["strategies"] = (ResidencyStrategy(args.strategy),)
    if args.no_progress:
        changes["progress"] = False
    return run_demo(replace(config, **changes))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``t2n-residency`` with ``argv`` (``sys.argv[1:]`` when ``None``).

    Returns:
        the exit status: 0 on success, 1 when the demo's verification failed, 2 for a usage
        error (bad flags, an unavailable device, missing optional dependencies).
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
        return _demo(args)
    except ImportError as exc:
        print(
            f"{_PROG}: error: the demo needs {exc.name or 'an optional package'}: "
            "pip install 'torch_to_nnef_tensor[demo]'",
            file=sys.stderr,
        )
        return 2
    except T2NError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
