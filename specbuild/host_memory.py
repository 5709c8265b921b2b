"""The memory this machine has available now (what a build or a benchmark checks before it starts)."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none: callers skip their check)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
