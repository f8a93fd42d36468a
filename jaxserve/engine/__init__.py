"""The engine: requests in, outputs out, one step (schedule -> launch -> read back -> update) at a time."""

from jaxserve.engine.engine import Engine

__all__ = ["Engine"]
