"""What the process holds open, read from ``/proc`` (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["open_descriptors"]


def open_descriptors(path: Path) -> list[str]:
    """What the process's open descriptors of ``path``, or of files under it (current or
    replaced), point to."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith(str(path)):
            found.append(target)
    return found
