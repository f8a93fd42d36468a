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
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens,
                             "prompt_tokens_details": None}  # null, as vLLM sends it
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
    # vLLM's encoding options: base64 of float16 (or bfloat16, fp8) numbers, in either byte order
    import ml_dtypes

    for dtype, endianness, numpy_type in (("float16", "little", "<f2"), ("float16", "big", ">f2"),
                                          ("bfloat16", "native", ml_dtypes.bfloat16)):
        packed = embed(real_server.url, input=TEXTS[1], encoding_format="base64", embed_dtype=dtype,
                       endianness=endianness).json()["data"][0]["embedding"]
        decoded = np.frombuffer(__import__("base64").b64decode(packed), numpy_type).astype(np.float32)
        np.testing.assert_allclose(decoded, expected[1], atol=1e-2)
    # use_activation false: the hidden state as it is, not scaled to unit length
    raw = embed(real_server.url, input=TEXTS[1], use_activation=False).json()["data"][0]["embedding"]
    assert np.linalg.norm(raw) > 1.5 and np.allclose(raw / np.linalg.norm(raw), expected[1], atol=1e-4)
    # truncation_side left keeps the last k tokens
    last = smol_engine.tokenizer(TEXTS[1])["input_ids"][-4:]
    left = embed(real_server.url, input=TEXTS[1], truncate_prompt_tokens=4, truncation_side="left").json()
    np.testing.assert_allclose(left["data"][0]["embedding"],
                               smol_engine.embed([last], use_tqdm=False)[0].outputs.embedding, atol=1e-4)
    # truncate_prompt_tokens embeds the input's first k tokens (vLLM 0.34's pooling truncation side).
    end = smol_engine.tokenizer(TEXTS[1])["input_ids"][:4]
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


def post(url, path, headers=AUTH, **body):
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_scores_are_the_engines_cosine_similarities(real_server, smol_engine, path):
    query, passages = "Where do cats sleep?", ["Cats sleep on mats.", "The stock market fell."]
    reply = post(real_server.url, path, model=REAL_MODEL, text_1=query, text_2=passages)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = [out.outputs.score for out in smol_engine.score(query, passages, use_tqdm=False)]
    assert body["object"] == "list" and body["id"].startswith("score-") and body["model"] == REAL_MODEL
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-4)
    tokens = sum(len(smol_engine.tokenizer(t)["input_ids"]) for t in [query, *passages])
    assert body["usage"]["prompt_tokens"] == tokens
    pairwise = post(real_server.url, path, text_1=passages, text_2=[query, query]).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], expected, atol=1e-4)  # cosine is symmetric


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_score(real_server, smol_engine, path):
    query = "Where do cats sleep?"
    documents = ["The stock market fell.", "Cats sleep on mats.", "Dogs bark at night."]
    scores = [out.outputs.score for out in smol_engine.score(query, documents, use_tqdm=False)]
    order = sorted(range(3), key=lambda i: -scores[i])
    reply = post(real_server.url, path, query=query, documents=[documents[0], {"text": documents[1]}, documents[2]],
                 top_n=2)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [r["index"] for r in body["results"]] == order[:2] and body["id"].startswith("rerank-")
    assert [r["document"]["text"] for r in body["results"]] == [documents[i] for i in order[:2]]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], [scores[i] for i in order[:2]],
                               atol=1e-4)
    assert body["usage"]["total_tokens"] == sum(len(smol_engine.tokenizer(t)["input_ids"]) for t in [query, *documents])
    bare = post(real_server.url, path, query=query, documents=documents, return_documents=False).json()
    assert [r["index"] for r in bare["results"]] == order and all(r["document"] is None for r in bare["results"])


@pytest.mark.parametrize("path, body, param, message", [
    ("/score", {"text_1": [], "text_2": "x"}, "text_1", "must not be empty"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_2", "text_1 has 2 texts and text_2 3"),
    ("/score", {"text_1": "a"}, "text_2", "Field required"),
    ("/v1/score", {"text_1": "a", "text_2": ["x", ""]}, "text_2", "empty string"),
    ("/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
    ("/rerank", {"query": "", "documents": ["x"]}, "query", "empty string"),
    ("/v1/rerank", {"query": "q", "documents": ["x"], "top_n": -1}, "top_n", "greater than or equal to 0"),
    ("/v2/rerank", {"query": "q", "documents": ["x"], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "positive integer"),
])
def test_bad_score_and_rerank_requests_are_400_naming_the_problem(real_server, path, body, param, message):
    reply = post(real_server.url, path, **body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_score_and_rerank_need_the_api_key(real_server):
    for path in ("/score", "/rerank", "/v2/rerank"):
        assert post(real_server.url, path, headers={}, text_1="a", text_2="b").status_code == 401, path
