"""LoRA adapters over HTTP (serve --lora-modules): a request's `model` picks the adapter, /v1/models lists them
under their base model, an unknown name is a 404 (the fake engine records which adapter each request got)."""

import httpx
import pytest

from jaxserve.async_engine import AsyncEngine
from jaxserve.lora_request import LoRARequest
from jaxserve.server.app import build_app
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import serve_in_thread

SQL = LoRARequest("sql", 1, "/adapters/sql")


@pytest.fixture(scope="module")
def server(tokenizer):
    fake = FakeEngine(tokenizer)
    app = build_app(AsyncEngine(fake, max_waiting_requests=8), served_model_names=["base"], lora_adapters={"sql": SQL})
    with serve_in_thread(app) as url:
        yield url, fake


def test_models_lists_adapters_under_their_base(server):
    url, _ = server
    cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == "/adapters/sql"
    assert cards["base"]["parent"] is None


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_the_model_field_picks_the_adapter(server, path, body):
    url, fake = server
    for model, expected in (("sql", SQL), ("base", None)):
        reply = httpx.post(url + path, json=body | {"model": model}, timeout=30)
        assert reply.status_code == 200 and reply.json()["model"] == model
        assert fake.lora_requests[reply.json()["id"]] == expected
    missing = httpx.post(url + path, json=body | {"model": "sq1"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
