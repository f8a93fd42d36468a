"""The asynchronous front end the HTTP server and batch jobs drive: an Engine stepped on a thread of its own,
admission and back-pressure, per-request streams, the step watchdog, data-parallel replicas."""

from jaxserve.async_engine.engine import AsyncEngine

__all__ = ["AsyncEngine"]
