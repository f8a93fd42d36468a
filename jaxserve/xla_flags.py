"""XLA flags jaxserve sets for its process before jax starts a backend (XLA reads XLA_FLAGS once, when the first
backend starts, and no per-program compiler option reaches these).

`--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED`: XLA:CPU's default scheduler orders a program for
running independent operations at once, so it starts every operation that does not wait on the activations
early: in a step over weights kept quantized (GGUF blocks, int4), every layer's dequantization, each result
alive until its layer runs. SmolLM2's 30 unrolled layers held 202 MiB of float32 weights at once where one layer
needs 3.4 MiB, and memory that size comes from the kernel afresh on every step (runner/host_allocator.py): the
same program ran 9x slower than in sequence. The sequential scheduler keeps one layer's temporaries alive at a
time. Measured side by side in BENCHMARKS.md (scripts/bench_cpu_env.py --compare scheduler). Accelerator
backends ignore XLA:CPU's flags.

The scheduler was a boolean, `--xla_cpu_enable_concurrency_optimized_scheduler`: jaxlib 0.10's XLA still takes it
but marks it deprecated (its DebugOptions field) for the enum above, which it takes too, with the same effect
(tests/test_xla_flags.py compiles a program under each). jaxserve sets the enum, the form a later XLA is likelier
to keep, and leaves XLA_FLAGS alone where it names either: the later of the two flags wins, so ours would override
a user's.

XLA refuses to start on a flag it does not know, so the flag is set only under the jaxlib versions it was
checked on (VERIFIED_JAXLIB): jaxlib 0.10 here. The GPU image's 0.11 is not checked yet (scripts/gpu_session.sh
reports whether it knows the flag); a GPU's steps do not need it."""

from __future__ import annotations

import os
from importlib import metadata

CPU_SCHEDULER_FLAG = "--xla_cpu_scheduler_type"
DEPRECATED_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"  # the same choice, as a boolean
VERIFIED_JAXLIB = ("0.10.",)  # jaxlib versions whose XLA knows CPU_SCHEDULER_FLAG


def cpu_scheduler_flag(concurrent: bool) -> str:
    """The XLA_FLAGS entry for XLA:CPU's concurrency-optimized scheduler (XLA's default) or the sequential,
    memory-optimized one (jaxserve's)."""
    kind = "CONCURRENCY_OPTIMIZED" if concurrent else "MEMORY_OPTIMIZED"
    return f"{CPU_SCHEDULER_FLAG}=CPU_SCHEDULER_TYPE_{kind}"


def set_default_xla_flags(environ=os.environ, jaxlib_version: str | None = None) -> None:
    """Add jaxserve's XLA flags to XLA_FLAGS, unless it already chooses a scheduler (a user's own value wins) or the
    installed jaxlib (`jaxlib_version`: None reads it) is not one they were checked on. Effective only before this
    process's first jax computation."""
    if jaxlib_version is None:
        try:
            jaxlib_version = metadata.version("jaxlib")
        except metadata.PackageNotFoundError:
            return
    flags = environ.get("XLA_FLAGS", "")
    chosen = CPU_SCHEDULER_FLAG in flags or DEPRECATED_SCHEDULER_FLAG in flags
    if jaxlib_version.startswith(VERIFIED_JAXLIB) and not chosen:
        environ["XLA_FLAGS"] = f"{flags} {cpu_scheduler_flag(concurrent=False)}".strip()
