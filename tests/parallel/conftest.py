"""Engines on several meshes share one opened checkpoint (reader and tokenizer) per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def shared_checkpoints():
    """Memoise `open_checkpoint` for the module: each mesh still loads and places its own weights."""
    from jaxserve import engine

    opened = {}
    real = engine.open_checkpoint

    def open_once(model, load_format="auto"):
        if (model, load_format) not in opened:
            opened[model, load_format] = real(model, load_format)
        return opened[model, load_format]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "open_checkpoint", open_once)
        yield
