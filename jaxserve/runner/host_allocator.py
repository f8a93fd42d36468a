"""Which malloc serves this process, and the advice a CPU engine logs when it is glibc's.

XLA:CPU allocates a step program's temporaries afresh on every execution. glibc hands any block over its mmap
threshold (32 MiB at most) straight from the kernel and returns it on free, so every step faults those pages in
again, one 4 KiB page at a time (~1.2 us each on the 2-core CI VM): a 108 MiB temporary cost 36 ms a step,
against 7 ms with tcmalloc, which keeps freed memory for the next step. The measured effect on whole engines is
in BENCHMARKS.md (scripts/bench_cpu_env.py). As for vLLM's CPU backend, the fix is the process's environment:
LD_PRELOAD=<libtcmalloc_minimal.so.4>, read by the dynamic loader before Python starts, so jaxserve can only
say so."""

from __future__ import annotations

import ctypes.util
import functools
from pathlib import Path

# Allocators that keep freed memory mapped for reuse, by the library name that shows in /proc/self/maps.
REUSING_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def mapped_allocator(maps: str | None = None) -> str | None:
    """The reusing allocator this process has loaded (`maps`: /proc/self/maps' text, read when None), or None:
    glibc's malloc, or a system without /proc."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    for line in maps.splitlines():
        library = line.rsplit("/", 1)[-1]
        for name in REUSING_ALLOCATORS:
            if library.startswith(f"lib{name}"):
                return name
    return None


@functools.cache  # find_library runs ldconfig: once a process
def installed_tcmalloc() -> str | None:
    """tcmalloc's library name where the dynamic loader finds one (LD_PRELOAD takes the name as it is)."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def allocator_advice(platform: str, maps: str | None = None, tcmalloc: str | None = None) -> str | None:
    """One line for a CPU engine's start-up log when steps allocate through glibc's malloc, naming the fix; None
    elsewhere (accelerators allocate from their own memory pools) or when a reusing allocator is loaded.
    `tcmalloc`: the library to preload (None: looked up)."""
    if platform != "cpu" or mapped_allocator(maps) is not None:
        return None
    library = tcmalloc or installed_tcmalloc()
    how = (f"start the process with LD_PRELOAD={library}" if library else
           "install tcmalloc (Debian/Ubuntu: apt install libtcmalloc-minimal4) and start the process with "
           "LD_PRELOAD=libtcmalloc_minimal.so.4")
    return (f"CPU steps allocate through glibc's malloc, which returns large blocks to the kernel after each step "
            f"and faults them in again on the next: {how} for faster steps (docs/serving.md, CPU performance)")
