"""JAX's persistent compilation cache: a restart (or another engine with the same shapes) reads compiled step
programs from disk instead of compiling them again."""

from __future__ import annotations

from pathlib import Path

import jax


def enable_compilation_cache(directory: str | None) -> None:
    if directory is None:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
