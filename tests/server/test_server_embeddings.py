"""POST /v1/embeddings on the real server (SmolLM2): the engine's embeddings, in input order, as floats or the
base64 the OpenAI SDK asks for by default; bad inputs are 400s naming the field."""

import httpx
import numpy as np
import pytest

from tests.server.helpers import API_KEY, REAL_MODEL, metric_value

AUTH = {"Authorization": f"Bearer {API_KEY}"}
METRICS = [("jaxserve:request_success_total", {"finished_reason": "stop"}), ("jaxserve:prompt_tokens_total", {}),
           ("jaxserve:generation_tokens_total", {})]
TEXTS = ["The cat sat on the mat.", "A dog ran through the park chasing a red ball."]


def embed(url, **body):
    return httpx.post(f"{url}/v1/embeddings", json=body, headers=AUTH, timeout=120)


def test_embeddings_are_the_engines_in_input_order(real_server, openai_client, smol_engine):
    expected = [o.outputs.embedding for o in smol_engine.embed(TEXTS, use_tqdm=False)]
    before = {name: metric_value(real_server.url, name, **labels) for name, labels in METRICS}
    reply = embed(real_server.url, input=TEXTS, model=REAL_MODEL)
    after = {name: metric_value(real_server.url, name, **labels) for name, labels in METRICS}
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == REAL_MODEL
    assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"embedding"}
    for data, want in zip(body["data"], expected):
        np.testing.assert_allclose(data["embedding"], want, atol=1e-4)
    tokens = sum(len(smol_engine.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
    # Counted in /metrics as requests that finished, with their prompt tokens and no generated ones.
    assert {name: after[name] - before[name] for name in after} == {
        "jaxserve:request_success_total": 2, "jaxserve:prompt_tokens_total": tokens,
        "jaxserve:generation_tokens_total": 0}
    # The SDK sends encoding_format="base64" unless told otherwise, and decodes the float32 bytes.
    sdk = openai_client.embeddings.create(model=REAL_MODEL, input=TEXTS[1])
    np.testing.assert_allclose(sdk.data[0].embedding, expected[1], atol=1e-4)
    short = openai_client.embeddings.create(model=REAL_MODEL, input=[TEXTS[0]], dimensions=64)
    assert len(short.data[0].embedding) == 64 and np.linalg.norm(short.data[0].embedding) == pytest.approx(1, abs=1e-5)
    ids = embed(real_server.url, input=smol_engine.tokenizer(TEXTS[0])["input_ids"]).json()  # token ids
    np.testing.assert_allclose(ids["data"][0]["embedding"], expected[0], atol=1e-4)
    # truncate_prompt_tokens embeds the input's last k tokens.
    end = smol_engine.tokenizer(TEXTS[1])["input_ids"][-4:]
    truncated = embed(real_server.url, input=TEXTS[1], truncate_prompt_tokens=4).json()
    assert truncated["usage"]["prompt_tokens"] == 4
    np.testing.assert_allclose(truncated["data"][0]["embedding"],
                               smol_engine.embed([end], use_tqdm=False)[0].outputs.embedding, atol=1e-4)


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["fine", ""]}, "input", "empty string"),
    ({"input": [[1, 2], [999999]]}, None, "outside the vocabulary"),
    ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "x", "dimensions": 100000}, None, "more than the model's 576"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "positive integer, -1"),
    ({"input": "x", "truncate_prompt_tokens": 5000}, None, "more than the model's maximum context length 512"),
])
def test_bad_embedding_requests_are_400_naming_the_problem(real_server, body, param, message):
    reply = embed(real_server.url, **body)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert message in error["message"] and (param is None or error["param"] == param)
