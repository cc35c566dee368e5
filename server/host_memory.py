"""Host memory for passes on the CPU: freed blocks stay in the process.

glibc's malloc serves large blocks with mmap and hands freed memory at the top of a heap back to
the system; a pass allocates and frees tens of megabytes of activations, so the next pass takes a
page fault (and the kernel zeroes a page) for every 4 KiB it touches again. Keeping freed memory
in the process, as a caching allocator does on a GPU, removes that cost: the process's resident
memory stays at its largest pass instead of shrinking between passes.

Scratch measurements (one thread, MiniLM, 32 SST-2 sentences, CPU time, fastest of 5-6 passes,
two runs each): the backbone stream in a thread, as the server runs it, bf16 144 / 140 ms -> 129 /
126 ms per batch; in the main thread fp32 400 / 395 -> 371 / 357 ms, bf16 151 / 148 -> 126 / 122 ms.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("tmod")

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # blocks under 1 GiB come from the heap, and up to 2 GiB of free heap is kept
TRIM_BYTES = 1 << 31


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory (see the module docstring). Returns whether it took
    effect: False on a C library without mallopt (musl, macOS), where nothing changes."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        log.info("host memory: no glibc mallopt here; the C library's own policy stays")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1
    if not done:
        log.warning("host memory: mallopt refused the thresholds; freed memory goes back to the system as before")
    return done
