"""The engine: requests in, outputs out, one step (schedule -> launch -> read back -> update) at a time.

`Engine` is imported on first use: it pulls in jax, which the light modules beside it (interface, the offline
API's helpers) and their importers (the server, AsyncEngine) must not pay for."""


def __getattr__(name):
    if name == "Engine":
        from jaxserve.engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
