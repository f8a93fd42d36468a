"""CORS and TLS (server/transport.py): off by default, vLLM's options turn them on, mistakes fail before the model
loads."""

import argparse
import ssl
import subprocess

import httpx
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.cli.args import UserError, parse_with_config
from jaxserve.cli.main import build_parser, main
from jaxserve.server.app import build_app
from jaxserve.server.transport import CORSPolicy, ssl_options
from tests.server.fake_engine import FakeEngine
from tests.server.fake_serve import fake_server_process
from tests.server.helpers import API_KEY, serve_in_thread

APP_ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def serve_args(*argv: str) -> argparse.Namespace:
    parser, subparsers = build_parser()
    return parse_with_config(parser, subparsers, ["serve", *argv])


def test_no_cors_headers_unless_origins_are_named(tokenizer):
    with serve_in_thread(build_app(AsyncEngine(FakeEngine(tokenizer, step_delay=0)))) as url:
        preflight = httpx.options(url + "/v1/chat/completions", headers=PREFLIGHT)
        answer = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Origin": APP_ORIGIN})
    assert "access-control-allow-origin" not in preflight.headers
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_named_origins_may_call_the_keyed_api_from_a_browser(tokenizer):
    cors = CORSPolicy.from_args(serve_args("--allowed-origins", f'["{APP_ORIGIN}"]'))
    app = build_app(AsyncEngine(FakeEngine(tokenizer, step_delay=0)), api_key=API_KEY, cors=cors)
    with serve_in_thread(app) as url:
        preflight = httpx.options(url + "/v1/chat/completions", headers=PREFLIGHT)  # browsers send no key here
        other_site = httpx.options(url + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        answer = httpx.post(url + "/v1/chat/completions", json=CHAT,
                            headers={"Origin": APP_ORIGIN, "Authorization": f"Bearer {API_KEY}"})
        refused = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Origin": APP_ORIGIN})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert other_site.status_code == 400 and "access-control-allow-origin" not in other_site.headers
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == APP_ORIGIN
    # The key check's 401 carries the CORS headers too, so the page can read why it was refused.
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == APP_ORIGIN


@pytest.mark.parametrize("argv, message", [
    (["--allowed-origins", "*", "--allow-credentials"], "list the origins instead"),
    (["--allowed-methods", '["GET"]'], "need --allowed-origins"),
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-ca-certs", "ca.pem"], "need --ssl-certfile"),
])
def test_inconsistent_options_are_refused_by_name(argv, message):
    with pytest.raises(UserError, match=message):
        args = serve_args(*argv)
        CORSPolicy.from_args(args)
        ssl_options(args)


def test_origins_take_vllm_json_lists_bare_strings_and_yaml_lists(tmp_path, capsys):
    assert serve_args("--allowed-origins", '["https://a.example", "https://b.example"]').allowed_origins == [
        "https://a.example", "https://b.example"]
    assert serve_args("--allowed-origins", "*").allowed_origins == ["*"]
    assert serve_args("--allowed-origins", "https://a.example, https://b.example").allowed_origins == [
        "https://a.example", "https://b.example"]
    tidied = CORSPolicy.from_args(serve_args("--allowed-origins", "https://a.example/", "--allowed-methods", "post"))
    assert tidied.origins == ("https://a.example",) and tidied.methods == ("POST",)
    config = tmp_path / "serve.yaml"
    config.write_text("allowed_origins: [https://a.example]\nallowed_headers: [content-type]\n")
    args = serve_args("--config", str(config))
    policy = CORSPolicy.from_args(args)
    assert policy.origins == ("https://a.example",) and policy.headers == ("content-type",)
    assert policy.methods == ("*",)
    with pytest.raises(SystemExit):
        serve_args("--allowed-origins", '["https://a.example", 3]')
    assert "expected a JSON list of strings" in capsys.readouterr().err


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key (the openssl command line ships with the OS)."""
    directory = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", directory / "key.pem",
                    "-out", directory / "cert.pem"], check=True, capture_output=True)
    return directory / "cert.pem", directory / "key.pem"


def test_serve_speaks_https_with_a_certificate(tokenizer_dir, certificate, tmp_path):
    cert, key = certificate
    args = ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    trusted = ssl.create_default_context(cafile=str(cert))
    with fake_server_process(tokenizer_dir, args, tmp_path / "serve.log", scheme="https", verify=trusted) as server:
        models = httpx.get(server.url + "/v1/models", verify=trusted, timeout=10)
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(server.url.replace("https", "http") + "/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"]
    assert f"listening on {server.url}" in server.log()


def test_a_bad_certificate_fails_in_one_line_before_any_model_loads(tmp_path, capsys, certificate):
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("not a certificate")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/nonexistent/model", "--ssl-certfile", str(not_pem)])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.count("\n") == 1
    assert "cannot set up TLS from" in error and str(not_pem) in error
    cert, _ = certificate
    with pytest.raises(SystemExit):  # a certificate without its key
        main(["serve", "/nonexistent/model", "--ssl-certfile", str(cert)])
    assert "cannot set up TLS" in capsys.readouterr().err
    for reqs in ("1", "2"):
        with pytest.raises(UserError, match=f"--ssl-cert-reqs {reqs} .* needs --ssl-ca-certs"):
            ssl_options(serve_args("--ssl-certfile", str(cert), "--ssl-cert-reqs", reqs))


def test_an_encrypted_key_is_refused_instead_of_prompting(tmp_path, certificate):
    cert, key = certificate
    encrypted = tmp_path / "encrypted.pem"
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:secret", "-out", encrypted],
                   check=True, capture_output=True)
    with pytest.raises(UserError, match="the key is not encrypted"):
        ssl_options(serve_args("--ssl-certfile", str(cert), "--ssl-keyfile", str(encrypted)))


def test_headers_without_authorization_under_an_api_key_are_warned_about(tokenizer_dir, tmp_path):
    args = ["--allowed-origins", APP_ORIGIN, "--allowed-headers", "content-type", "--api-key", API_KEY]
    with fake_server_process(tokenizer_dir, args, tmp_path / "serve.log") as server:
        pass
    assert server.log().count("does not include Authorization") == 1
    assert not CORSPolicy.from_args(serve_args("--allowed-origins", APP_ORIGIN)).blocks_authorization()


def test_root_path_serves_with_or_without_the_prefix_and_keeps_the_key_check(tokenizer_dir, tmp_path):
    """--root-path /llm/: a proxy that strips the prefix and one that passes it on are both served; the key check
    sees /llm/v1/... as the /v1/ route it is (a raw-path check would let it through without the key)."""
    key = {"Authorization": f"Bearer {API_KEY}"}
    args = ["--root-path", "/llm/", "--api-key", API_KEY, "--enable-request-id-headers"]
    with fake_server_process(tokenizer_dir, args, tmp_path / "serve.log") as server:
        traced = httpx.get(server.url + "/llm/health", headers={"X-Request-Id": "abc"}, timeout=10)
        answers = {path: (httpx.get(server.url + path, headers=key, timeout=10).status_code,
                          httpx.get(server.url + path, timeout=10).status_code)
                   for path in ("/v1/models", "/llm/v1/models", "/llm/score", "/llmv1/models", "/llm/health")}
    assert answers == {"/v1/models": (200, 401), "/llm/v1/models": (200, 401), "/llm/score": (405, 401),
                       "/llmv1/models": (404, 404), "/llm/health": (200, 200)}
    assert "served under /llm too" in server.log() and traced.headers["x-request-id"] == "abc"


def test_request_id_headers_echo_the_clients_or_make_one(tokenizer):
    app = build_app(AsyncEngine(FakeEngine(tokenizer, step_delay=0)), request_id_headers=True, api_key=API_KEY)
    with serve_in_thread(app) as url:
        given = httpx.get(url + "/health", headers={"X-Request-Id": "trace-42"})
        made = [httpx.get(url + "/health").headers.get("x-request-id") for _ in range(2)]
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True},
                          headers={"Authorization": f"Bearer {API_KEY}"}) as streamed:
            streamed.read()
        refused = httpx.get(url + "/v1/models")  # the key check's own answer gets one too
    with serve_in_thread(build_app(AsyncEngine(FakeEngine(tokenizer, step_delay=0)))) as url:
        plain = httpx.get(url + "/health", headers={"X-Request-Id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    assert all(made) and made[0] != made[1]
    assert streamed.status_code == 200 and streamed.headers["x-request-id"]
    assert refused.status_code == 401 and refused.headers["x-request-id"]
    assert "x-request-id" not in plain.headers


def test_root_path_must_be_a_path(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--root-path", "llm"])
    assert "'llm' must start with '/', e.g. /llm" in capsys.readouterr().err
