"""/openapi.json describes every route the app serves, with the request and response schemas the routes validate
and answer with, and the key only where the app asks for one; /docs renders it."""

import json
import re

import httpx
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.server.app import ROUTES, build_app
from jaxserve.server.chat_protocol import ChatCompletionRequest
from jaxserve.server.openapi import openapi_document
from jaxserve.server.transport import PROTECTED_PATHS, PROTECTED_PREFIXES
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import API_KEY, serve_in_thread

SELF = {"/openapi.json", "/docs"}


def test_every_route_is_described_and_nothing_else():
    served = {(route.path, method.lower()) for route in ROUTES if route.path not in SELF
              for method in route.methods - {"HEAD"}}
    described = {(path, method) for path, item in openapi_document()["paths"].items() for method in item}
    assert described == served


def test_the_key_is_asked_where_the_app_asks_for_it():
    for path, item in openapi_document()["paths"].items():
        protected = path.startswith(PROTECTED_PREFIXES) or path in PROTECTED_PATHS
        for method, operation in item.items():
            assert ("security" in operation) == protected, (path, method)


def test_bodies_are_the_schemas_requests_are_validated_with():
    doc = openapi_document()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schemas = doc["components"]["schemas"]
    chat = schemas[body["$ref"].rsplit("/", 1)[1]]
    assert chat == {k: v for k, v in ChatCompletionRequest.model_json_schema(
        ref_template="#/components/schemas/{model}").items() if k != "$defs"}
    assert "messages" in chat["required"]
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs and refs <= set(schemas)  # every reference resolves


@pytest.fixture(scope="module")
def keyed_server(tokenizer):
    with serve_in_thread(build_app(AsyncEngine(FakeEngine(tokenizer, step_delay=0)), api_key=API_KEY)) as url:
        yield url


def test_served_without_the_key_and_rendered(keyed_server):
    served = httpx.get(f"{keyed_server}/openapi.json")
    assert served.status_code == 200 and served.json() == json.loads(json.dumps(openapi_document()))
    assert served.json()["openapi"] == "3.1.0"
    page = httpx.get(f"{keyed_server}/docs")
    assert page.status_code == 200 and 'url: "openapi.json"' in page.text
