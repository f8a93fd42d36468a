"""Engines on several meshes share one opened checkpoint (reader and tokenizer) per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def shared_checkpoints():
    """Memoise `open_checkpoint` for the module: each mesh still loads and places its own weights."""
    from jaxserve import engine

    opened = {}
    real = engine.open_checkpoint

    def open_once(model):
        if model not in opened:
            opened[model] = real(model)
        return opened[model]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "open_checkpoint", open_once)
        yield
