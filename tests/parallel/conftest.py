"""Engines on several meshes share one opened checkpoint (reader and tokenizer) per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def shared_checkpoints():
    """Memoise `open_checkpoint` for the module: each mesh still loads and places its own weights."""
    from jaxserve.engine import engine

    opened = {}
    real = engine.open_checkpoint

    def open_once(*args, **kwargs):  # whatever open_checkpoint takes: the key is all of it
        key = repr((args, sorted(kwargs.items())))
        if key not in opened:
            opened[key] = real(*args, **kwargs)
        return opened[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "open_checkpoint", open_once)
        yield
