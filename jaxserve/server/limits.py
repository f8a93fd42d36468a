"""A cap on request body size, so that one client cannot make the server buffer (and parse) gigabytes.

Pure ASGI, like the API-key check: a declared Content-Length over the cap is answered 413 before a byte of the
body is read; a chunked body is counted as it arrives and refused the moment it passes the cap.
"""

from __future__ import annotations

from starlette.datastructures import Headers

from jaxserve.server.errors import body_too_large

# Roomy for any real prompt (128k tokens of text is well under 1 MiB; as token ids, about 1 MiB), small enough
# that parsing a body at the cap takes a fraction of a second.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


class BodySizeLimitMiddleware:
    def __init__(self, app, max_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.max_body_bytes is None:
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await body_too_large(self.max_body_bytes).response()(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive):
        """`receive`, raising a 413 APIError once the body passes the cap (the route's error handler answers)."""
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise body_too_large(self.max_body_bytes)
            return message

        return counting_receive
