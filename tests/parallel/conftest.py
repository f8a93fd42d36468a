"""Engines on several meshes share one opened checkpoint (reader and tokenizer) per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def shared_checkpoints():
    """Memoise `open_checkpoint` for the module: each mesh still loads and places its own weights."""
    from jaxserve import engine

    opened = {}
    real = engine.open_checkpoint

    def open_once(model, load_format="auto", hf_overrides=None):
        key = (model, load_format, repr(hf_overrides))
        if key not in opened:
            opened[key] = real(model, load_format, hf_overrides)
        return opened[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "open_checkpoint", open_once)
        yield
