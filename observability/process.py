"""Resident memory and CPU time of a process, read from /proc (Linux; 0 elsewhere)."""

from __future__ import annotations

import os


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of the process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel too (``top -H``, ``/proc/<pid>/task/*/comm``
    and per-thread CPU figures show it; Linux keeps 15 bytes); a no-op elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
