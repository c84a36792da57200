"""The GGUF's pages that a loaded model no longer needs, handed back to the kernel.

llama.cpp maps the whole GGUF and, after the load, unmaps only what lies before the first and
after the last tensor it serves from the mapping (the CPU's tensors). The peer's layers sit
between the token embeddings (first in the file, always on the CPU) and the output layer
(last), so with a CPU local stage their pages stay mapped in the engine's process after they
were sent over the link: a second copy of the peer's half on the local node, in its page cache.
With a GPU local stage the mapping is cut, but the pages stay cached all the same; on a machine
whose GPU shares the memory (a DGX Spark) that cache competes with the weights themselves.

``release(path, prefixes)`` drops the pages of the tensors named so (those that live in another
device's memory: the peer's, a local GPU's) from this process's mappings of ``path``
(``madvise(MADV_DONTNEED)``: a file-backed page that is touched again is read back from the
file, the same bytes) and then from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``).
Pages shared with a kept tensor are kept: ranges are cut to whole pages inside each tensor.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

log = logging.getLogger(__name__)

MADV_DONTNEED = 4


def tensor_ranges(path: str, prefixes: tuple[str, ...]) -> list[tuple[int, int]]:
    """File ranges [start, end) of the data of the tensors whose names start with ``prefixes``."""
    if not prefixes:
        return []
    from engine.native.gguf_shape import read_header

    return sorted((t.data_offset, t.data_offset + t.n_bytes) for t in read_header(path).tensors
                  if t.name.startswith(prefixes))


def _mappings(path: str) -> list[tuple[int, int, int]]:
    """(address, file offset, length) of this process's mappings of ``path``."""
    st = os.stat(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            cols = line.split(maxsplit=5)
            if len(cols) < 6 or int(cols[4]) != st.st_ino:
                continue
            major, minor = (int(x, 16) for x in cols[3].split(":"))
            if os.makedev(major, minor) != st.st_dev:
                continue
            lo, hi = (int(x, 16) for x in cols[0].split("-"))
            out.append((lo, int(cols[2], 16), hi - lo))
    return out


def release(path: str, prefixes: tuple[str, ...]) -> int:
    """Drop the pages of the tensors of the GGUF at ``path`` whose names start with ``prefixes``
    from this process and the page cache; returns the bytes of whole pages released."""
    ranges = tensor_ranges(path, prefixes)
    if not ranges:
        return 0
    page = mmap.PAGESIZE
    whole = [(-(-a // page) * page, b // page * page) for a, b in ranges]
    whole = [(a, b) for a, b in whole if b > a]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for addr, off, n in _mappings(path):
        for a, b in whole:
            lo, hi = max(a, off), min(b, off + n)
            if hi > lo and libc.madvise(addr + lo - off, hi - lo, MADV_DONTNEED) != 0:
                log.debug("madvise failed: %s", os.strerror(ctypes.get_errno()))
    fd = os.open(path, os.O_RDONLY)
    try:
        for a, b in whole:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return sum(b - a for a, b in whole)


def resident_bytes(path: str, ranges: list[tuple[int, int]] | None = None) -> int:
    """Bytes of ``path`` (or of its ``ranges``) in the page cache, by mincore over a mapping."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = os.path.getsize(path), mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            pages = vec.raw
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    spans = ranges if ranges is not None else [(0, size)]
    return sum(page * sum(b & 1 for b in pages[a // page:-(-e // page)]) for a, e in spans)
