"""LoRA adapters over HTTP (serve --lora-modules): a request's `model` picks the adapter, /v1/models lists them
under their base model, an unknown name is a 404 (the fake engine records which adapter each request got)."""

import httpx
import pytest

from jaxserve.async_engine.engine import AsyncEngine
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


def test_runtime_loading_is_off_unless_the_server_allows_it(server):
    url, _ = server
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        reply = httpx.post(f"{url}/v1/{route}", json={"lora_name": "sql", "lora_path": "/adapters/sql"})
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "runtime_lora_updating_off"
        assert "--enable-runtime-lora-updating" in reply.json()["error"]["message"]


@pytest.fixture
def updatable(tokenizer):
    fake = FakeEngine(tokenizer)
    app = build_app(AsyncEngine(fake, max_waiting_requests=8), served_model_names=["base"], lora_adapters={"sql": SQL},
                    runtime_lora_updating=True)
    with serve_in_thread(app) as url:
        yield url, fake


def _adapter_dir(tmp_path, name):
    (tmp_path / name).mkdir()
    (tmp_path / name / "adapter_config.json").write_text("{}")
    return str(tmp_path / name)


def _served(url):
    return {card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]}


def test_adapters_are_loaded_and_unloaded_over_http(updatable, tmp_path):
    """vLLM's routes and replies: the loaded adapter is served under its name with a new id, until unloaded."""
    url, fake = updatable
    body = {"prompt": "Hello", "max_tokens": 2, "model": "poems"}
    path = _adapter_dir(tmp_path, "poems")
    reply = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "poems", "lora_path": path})
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'poems' added successfully."
    assert _served(url) == {"base", "sql", "poems"}
    completion = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    assert fake.lora_requests[completion["id"]] == LoRARequest("poems", 2, path)  # ids after --lora-modules' 1
    for name in ("poems", "sql", "base"):  # names already served
        again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        message = again.json()["error"]["message"]
        assert again.status_code == 400 and ("already been loaded" in message or "served model's name" in message)
    reply = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poems"})
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'poems' removed successfully."
    assert _served(url) == {"base", "sql"} and fake.removed_loras == ["poems"]
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 404
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poems"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_adapter_not_found"
    reloaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "poems", "lora_path": path})
    completion = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    assert reloaded.status_code == 200 and fake.lora_requests[completion["id"]].lora_int_id == 3  # never reused


def test_an_unloaded_name_can_be_loaded_from_other_files_at_once_while_the_engine_is_busy(tokenizer, tmp_path):
    """The unload is applied between steps; a load of the same name right after it waits for that, instead of
    finding the name still taken (a 400 'already in use', and neither adapter served)."""
    import threading

    fake = FakeEngine(tokenizer, step_delay=0.2)
    app = build_app(AsyncEngine(fake, max_waiting_requests=8), served_model_names=["base"], runtime_lora_updating=True)
    with serve_in_thread(app) as url:
        first, second = _adapter_dir(tmp_path, "v1"), _adapter_dir(tmp_path, "v2")
        assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": first}).status_code == 200
        busy = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                kwargs={"json": {"prompt": "Hi", "max_tokens": 4, "model": "base"}, "timeout": 30})
        fake.step_started.clear()
        busy.start()
        assert fake.step_started.wait(10)
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        reply = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": second}, timeout=30)
        busy.join()
        assert reply.status_code == 200, reply.text
        assert fake.loaded_loras == {"a": second} and _served(url) == {"base", "a"}


def test_load_inplace_replaces_an_adapter_under_its_name(updatable, tmp_path):
    """vLLM's load_inplace: the name stays served and runs with the new files under a new id; a directory it
    cannot serve leaves the old adapter serving."""
    url, fake = updatable
    body = {"prompt": "Hello", "max_tokens": 2, "model": "sql"}
    path = _adapter_dir(tmp_path, "sql-v2")
    load = {"lora_name": "sql", "lora_path": path, "load_inplace": True}
    reply = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
    assert reply.status_code == 200 and fake.replaced_loras == ["sql"] and fake.removed_loras == []
    completion = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    assert fake.lora_requests[completion["id"]] == LoRARequest("sql", 2, path) and _served(url) == {"base", "sql"}
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json=load | {"lora_path": "/nowhere"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    completion = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    assert fake.lora_requests[completion["id"]] == LoRARequest("sql", 2, path)
    base = httpx.post(f"{url}/v1/load_lora_adapter", json=load | {"lora_name": "base"})
    assert base.status_code == 400 and "served model's name" in base.json()["error"]["message"]


@pytest.mark.parametrize("body, param, message", [
    ({"lora_name": "x", "lora_path": "/nowhere"}, "lora_path", "/nowhere has no adapter_config.json"),
    ({"lora_name": "", "lora_path": "/adapters/x"}, "lora_name", "must be non-empty"),
    ({"lora_name": "x"}, "lora_path", "Field required"),
    ({"lora_name": 5, "lora_path": "/adapters/x"}, "lora_name", "valid string"),
])
def test_bad_load_requests_get_400_naming_the_field(updatable, body, param, message):
    url, _ = updatable
    reply = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert _served(url) == {"base", "sql"}
