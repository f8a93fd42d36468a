"""Security: the API key guards every /v1 route (compared in constant time), the server binds loopback by default,
checkpoints load without pickle, chat templates render in a sandbox, and prompts stay out of the logs."""

import asyncio
import copy
import fnmatch
import hmac
import json
import logging
import pickle
import re
from pathlib import Path

import httpx
import pytest

import jaxserve
from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.cli.main import build_parser
from jaxserve.loader import checkpoint
from jaxserve.loader.tokenizer import apply_chat_template
from jaxserve.server.app import ROUTES, build_app
from tests.server.fake_engine import FakeEngine
from tests.server.fake_serve import fake_server_process
from tests.server.helpers import API_KEY, serve_in_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Every route but these answers only with the key: a new route is covered unless it is added here on purpose.
OPEN_ROUTES = {"/health", "/metrics", "/version", "/tokenize", "/detokenize", "/openapi.json", "/docs"}
API_ROUTES = [(route.path, method) for route in ROUTES if route.path not in OPEN_ROUTES
              for method in sorted(route.methods - {"HEAD"})]


@pytest.fixture(scope="module")
def keyed_server(tokenizer):
    engine = AsyncEngine(FakeEngine(tokenizer, step_delay=0))
    with serve_in_thread(build_app(engine, api_key=API_KEY, runtime_lora_updating=True)) as url:
        yield url


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adapter")
    (directory / "adapter_config.json").write_text("{}")
    return str(directory)


# --- API key ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, method", API_ROUTES)
def test_every_api_route_needs_the_key(keyed_server, adapter_dir, path, method):
    body = {"prompt": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
            "lora_name": "x", "lora_path": adapter_dir, "input": "x", "text_1": "x", "text_2": "y", "query": "x",
            "documents": ["y"]}
    if path.startswith("/v1/responses"):
        body = {"input": "x", "max_output_tokens": 1}  # chat's fields are refused there by name
    if path == "/v1/chat/completions":
        body.pop("documents")  # rerank's texts; chat's documents are a template's {"title", "text"} passages
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": f"bearer {API_KEY}"}):
        response = httpx.request(method, keyed_server + path, json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", headers
    if path == "/v1/unload_lora_adapter":  # something to unload, whichever worker ran the load route's case
        httpx.post(keyed_server + "/v1/load_lora_adapter", json=body, headers=AUTH)
    keyed = httpx.request(method, keyed_server + path, json=body, headers=AUTH)
    # With the key, the route answers: a path naming a stored response ("{response_id}" here) finds none.
    assert keyed.status_code == (404 if "{" in path else 200), keyed.text


@pytest.mark.parametrize("path", ["/v1/completions/", "//v1/completions", "/v1//completions", "/%76%31/completions",
                                  "/V1/completions", "/v1/completions?x=/health"])
def test_path_tricks_do_not_bypass_the_key(keyed_server, path):
    response = httpx.post(keyed_server + path, json={"prompt": "x", "max_tokens": 1}, follow_redirects=False)
    assert response.status_code in (401, 404, 405), (path, response.status_code)


def test_key_is_compared_in_constant_time(keyed_server, monkeypatch):
    compared = []
    real_compare = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real_compare(a, b))
    assert httpx.get(keyed_server + "/v1/models", headers=AUTH).status_code == 200
    assert compared == [(AUTH["Authorization"].encode(), AUTH["Authorization"].encode())]


def test_serve_binds_loopback_unless_told_otherwise():
    args = build_parser()[0].parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.api_key is None


# --- no pickle --------------------------------------------------------------------------------------------------
class _Exploit:
    """Unpickling this writes a marker file: proof that a pickle was loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def test_a_pickle_only_checkpoint_is_refused_without_unpickling(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5}
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "marker"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(FileNotFoundError, match="no model.safetensors .* jaxserve loads safetensors checkpoints"):
        checkpoint.open_checkpoint(str(model))
    assert not marker.exists()


def test_hub_downloads_fetch_no_pickle_files(monkeypatch, tmp_path):
    import huggingface_hub

    asked = {}
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, allow_patterns, **_: asked.update(patterns=allow_patterns) or str(tmp_path))
    checkpoint._download_from_hub("someone/model")
    pickles = ["pytorch_model.bin", "model.pt", "weights.pth", "optimizer.pkl", "training_args.bin", "x.ckpt"]
    assert not [name for name in pickles if any(fnmatch.fnmatch(name, p) for p in asked["patterns"])]


UNPICKLING = [r"^\s*(import|from)\s+(pickle|dill|joblib|cloudpickle)\b", r"\bpickle\.loads?\(", r"torch\.load\(",
              r"allow_pickle\s*=\s*True", r"trust_remote_code\s*=\s*True"]


def test_no_package_code_can_unpickle():
    for path in Path(jaxserve.__file__).parent.rglob("*.py"):
        source = path.read_text()
        for pattern in UNPICKLING:
            assert not re.search(pattern, source, re.MULTILINE), f"{path}: {pattern}"


# --- sandboxed chat templates -----------------------------------------------------------------------------------
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ self._TemplateReference__context.joiner.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{% for i in range(10**9) %}x{% endfor %}",
]


def with_template(tokenizer, template: str):
    evil = copy.copy(tokenizer)  # shallow: only the template differs
    evil.chat_template = template
    return evil


@pytest.mark.parametrize("template", ESCAPES)
def test_chat_template_cannot_reach_python_internals(tokenizer, template, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="(?i)the chat template could not render these messages: .*(unsafe|range)"):
        apply_chat_template(with_template(tokenizer, template), [{"role": "user", "content": "hi"}])
    assert not (tmp_path / "MARKER").exists()


def test_a_malicious_template_is_a_400_and_the_server_carries_on(tokenizer):
    engine = AsyncEngine(FakeEngine(with_template(tokenizer, ESCAPES[1]), step_delay=0))
    with serve_in_thread(build_app(engine)) as url:
        response = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400 and "unsafe" in response.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200


# --- prompts out of the logs ------------------------------------------------------------------------------------
SECRET = "my-credit-card-4111-1111"


def send_prompts_everywhere(url: str) -> None:
    """The secret as completion, chat, streamed, and invalid requests: every path that could log it."""
    requests = [("/v1/completions", {"prompt": SECRET, "max_tokens": 2}),
                ("/v1/completions", {"prompt": SECRET, "max_tokens": 2, "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 2}),
                ("/v1/completions", {"prompt": SECRET, "logprobs": 99}),
                ("/v1/chat/completions", {"messages": [{"role": SECRET}]})]
    for path, body in requests:
        httpx.post(url + path, json=body, timeout=10)


@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompts_are_logged_only_when_asked(tokenizer, caplog, log_prompts):
    caplog.set_level(logging.DEBUG)
    engine = AsyncEngine(FakeEngine(tokenizer, step_delay=0), log_prompts=log_prompts)
    with serve_in_thread(build_app(engine)) as url:
        send_prompts_everywhere(url)
    assert (SECRET in caplog.text) == log_prompts


def test_max_log_len_cuts_logged_prompts(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve")
    engine = AsyncEngine(FakeEngine(tokenizer, step_delay=0), log_prompts=True, max_log_len=8)
    with serve_in_thread(build_app(engine)) as url:
        httpx.post(url + "/v1/completions", json={"prompt": SECRET, "max_tokens": 1}, timeout=10)
    logged = [record.getMessage() for record in caplog.records if "prompt" in record.getMessage()]
    assert logged and all(SECRET not in line and SECRET[:7] in line for line in logged)


def test_serve_options_reach_the_server(tokenizer_dir, tmp_path):  # noqa: F811 - the fixture
    """--log-prompts, --request-timeout, --max-request-body-bytes, --max-waiting-requests and
    --disable-fastapi-docs, through the real `serve` command line."""
    args = ["--log-prompts", "--max-log-len", "500", "--request-timeout", "0.5", "--max-request-body-bytes", "2000",
            "--max-waiting-requests", "1", "--disable-fastapi-docs"]
    with fake_server_process(tokenizer_dir, args, tmp_path / "serve.log", step_delay=0.02) as server:
        assert [httpx.get(server.url + path).status_code for path in ("/openapi.json", "/docs", "/health")] == [
            404, 404, 200]
        send_prompts_everywhere(server.url)
        slow = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 200}, timeout=10)
        big = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 3000}, timeout=10)
        burst = asyncio.run(_burst(server.url, 12))
    assert slow.status_code == 504 and big.status_code == 413
    assert {response.status_code for response in burst} == {200, 503}  # one may wait for its first token
    rejected = next(response for response in burst if response.status_code == 503)
    assert rejected.json()["error"]["code"] == "queue_full" and rejected.headers["retry-after"].isdigit()
    assert SECRET in server.log()


async def _burst(url: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        body = {"prompt": "Hello", "max_tokens": 2}
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(count)))
