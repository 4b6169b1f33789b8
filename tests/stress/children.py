"""Child processes for the crash and disk-full tests, forked from a preloaded forkserver.

Importing torch takes seconds; a ``forkserver`` that imported torch and the library once forks
each child in milliseconds, so that a test can kill and restart many of them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import runpy
from pathlib import Path
from typing import Any

__all__ = ["WORKERS_FILE", "context", "start_worker"]

WORKERS_FILE = Path(__file__).with_name("workers.py")
_PRELOAD = ["torch", "torch_to_nnef.tensor.offload", "torch_to_nnef.tensor.residency"]


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, with torch and the library preloaded in the server."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(_PRELOAD)
    return forkserver


def start_worker(job: str, **arguments: Any) -> multiprocessing.process.BaseProcess:
    """Start a child running the function ``job`` of ``workers.py`` with ``arguments``."""
    process = context().Process(
        target=runpy.run_path,
        args=(str(WORKERS_FILE),),
        kwargs={
            "init_globals": {"T2N_JOB": job, "T2N_ARGS": arguments},
            "run_name": "t2n_stress_worker",
        },
        daemon=True,
    )
    process.start()
    return process
