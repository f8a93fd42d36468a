"""How the server meets browsers, networks and proxies: CORS, TLS and a root path, with vLLM's option names.

CORS is off unless `--allowed-origins` names origins. vLLM allows every origin by default; here a browser page
from another site cannot call a server on the user's machine or network unless the operator says so (a local,
key-less server would otherwise answer any web page the user visits). When origins are named, methods and headers
default to all, as in vLLM.

TLS: `--ssl-keyfile`/`--ssl-certfile` (and `--ssl-ca-certs` with `--ssl-cert-reqs 2` for client certificates)
are checked when the command starts, so a wrong path or key fails in a second rather than after the model loads.

`--enable-request-id-headers`: every response carries X-Request-Id, the client's own or a new one, so a request can
be followed through proxies and logs (as in vLLM).

`--root-path /llm`: the server sits behind a proxy under that prefix. As in vLLM (FastAPI's root_path), requests
are answered with or without it, so a proxy that strips the prefix and one that passes it on both work.
"""

from __future__ import annotations

import argparse
import ssl
import uuid
from dataclasses import dataclass

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from jaxserve.errors import UserError


@dataclass(frozen=True)
class CORSPolicy:
    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CORSPolicy | None:
        if not args.allowed_origins:
            if args.allow_credentials or args.allowed_methods or args.allowed_headers:
                raise UserError("--allow-credentials, --allowed-methods and --allowed-headers need "
                                "--allowed-origins to name the origins they apply to (e.g. '[\"https://app.example\"]')")
            return None
        if args.allow_credentials and "*" in args.allowed_origins:
            # Browsers refuse credentialed responses to a wildcard origin; Starlette would echo any origin
            # instead, which hands every site the user's cookies. Make the operator list them.
            raise UserError("--allow-credentials with --allowed-origins '*' would let every site send the "
                            "user's credentials; list the origins instead")
        headers = tuple(args.allowed_headers or ("*",))
        # A browser's Origin never ends in "/" and its methods are upper case; Starlette compares them as given.
        origins = tuple(origin if origin == "*" else origin.rstrip("/") for origin in args.allowed_origins)
        methods = tuple(method.upper() for method in args.allowed_methods or ("*",))
        return cls(origins, methods, headers, args.allow_credentials)

    def blocks_authorization(self) -> bool:
        """Whether browsers may not send an Authorization header (which an --api-key needs) to this server."""
        return "*" not in self.headers and "authorization" not in {h.lower() for h in self.headers}

    def middleware(self) -> Middleware:
        return Middleware(CORSMiddleware, allow_origins=list(self.origins), allow_methods=list(self.methods),
                          allow_headers=list(self.headers), allow_credentials=self.credentials)


def ssl_options(args: argparse.Namespace) -> dict:
    """uvicorn.Config's TLS keywords from the serve options, after checking that they make a TLS context."""
    if args.ssl_keyfile and not args.ssl_certfile:
        raise UserError("--ssl-keyfile needs --ssl-certfile (the certificate that goes with the key)")
    if not args.ssl_certfile:
        if args.ssl_ca_certs or args.ssl_cert_reqs:
            raise UserError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile: they configure TLS")
        return {}
    if args.ssl_cert_reqs != ssl.CERT_NONE and not args.ssl_ca_certs:
        raise UserError(f"--ssl-cert-reqs {args.ssl_cert_reqs} (ask for client certificates) needs --ssl-ca-certs "
                        "to verify them")
    options = dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                   ssl_cert_reqs=args.ssl_cert_reqs)
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # what uvicorn builds from the same files
        # An empty password: an encrypted key fails here instead of OpenSSL prompting on the terminal.
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=b"")
        if args.ssl_ca_certs:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        files = ", ".join(f for f in (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs) if f)
        raise UserError(f"cannot set up TLS from {files} ({exc.strerror or exc}); check that the certificate "
                        "and key are PEM files that belong together, and that the key is not encrypted") from None
    return options


class RootPathMiddleware:
    """Sets the ASGI root_path, which Starlette's routing takes off a path that starts with it. Unlike uvicorn's
    --root-path, the request's path is left as it came, so it is served with the prefix or without."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


# Only the API routes need a key; health, metrics, tokenisation and the API description stay open, as in vLLM.
PROTECTED_PREFIXES = ("/v1/", "/v2/")
PROTECTED_PATHS = {"/score", "/rerank", "/classify"}


def needs_api_key(path: str) -> bool:
    """Whether a routed path (`route_path`) answers only with the API key, when the server has one."""
    return path.startswith(PROTECTED_PREFIXES) or path in PROTECTED_PATHS


def route_path(scope) -> str:
    """The path the routes match, as Starlette's routing finds it: without the root path if it starts with it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


class RequestIdMiddleware:
    """Pure ASGI (streaming-safe): puts the request's X-Request-Id, or a new one, on the response's headers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
