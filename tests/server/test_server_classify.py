"""Sequence classifiers over HTTP: POST /classify answers with the engine's class probabilities, and on a
cross-encoder (one label) /score and /rerank score each pair as one prompt; a classifier refuses to generate or
embed, and a causal LM refuses /classify, each as a 400 that says why."""

import httpx
import numpy as np
import pytest

from jaxserve import Engine
from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.server.app import build_app
from tests.helpers import make_tiny_classifier
from tests.server.helpers import REAL_MODEL, serve_in_thread

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["The food was wonderful.", "It rained all day and the trip was ruined.", "A table."]
QUERY, DOCUMENTS = "Where is the Eiffel Tower?", ["It stands in Paris.", "Bananas are yellow.", "Tall iron towers."]


def _serve(path):
    engine = Engine(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                    warmup=False)
    return engine, serve_in_thread(build_app(AsyncEngine(engine), served_model_names=["clf"]))


@pytest.fixture(scope="module")
def classifier(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("classifier")
    make_tiny_classifier(tiny_checkpoint("qwen3"), path, 3, id2label=LABELS,
                         label2id={v: k for k, v in LABELS.items()})
    engine, server = _serve(path)
    with server as url:
        yield url, engine


@pytest.fixture(scope="module")
def cross_encoder(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("cross-encoder")
    make_tiny_classifier(tiny_checkpoint("qwen3"), path, 1)
    engine, server = _serve(path)
    with server as url:
        yield url, engine


def post(url, path, **body):
    return httpx.post(url + path, json=body, timeout=120)


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify_answers_with_the_engines_probabilities(classifier, path):
    url, engine = classifier
    expected = engine.classify(TEXTS, use_tqdm=False)
    reply = post(url, path, model="clf", input=TEXTS)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == "clf" and body["id"].startswith("classify-")
    for index, (data, want) in enumerate(zip(body["data"], expected)):
        assert data["index"] == index and data["num_classes"] == 3 and data["label"] == want.outputs.label
        assert data["probs"] == pytest.approx(want.outputs.probs, abs=1e-5)
    tokens = sum(len(out.prompt_token_ids) for out in expected)
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens,
                             "prompt_tokens_details": None}  # null, as vLLM sends it
    logits = post(url, path, input=TEXTS[:1], use_activation=False).json()["data"][0]  # vLLM's: the raw logits
    probs = np.exp(logits["probs"]) / np.exp(logits["probs"]).sum()
    assert probs == pytest.approx(expected[0].outputs.probs, abs=1e-5) and logits["label"] == expected[0].outputs.label
    ids = expected[1].prompt_token_ids
    one = post(url, path, input=ids, truncate_prompt_tokens=4).json()  # token ids, truncated to the first 4
    assert one["usage"]["prompt_tokens"] == 4
    assert one["data"][0]["probs"] == pytest.approx(engine.classify([ids[:4]], use_tqdm=False)[0].outputs.probs,
                                                    abs=1e-5)


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "is a sequence classifier"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "does not generate"),
    ("/v1/embeddings", {"input": "Hi"}, "does not embed"),
    ("/score", {"text_1": "a", "text_2": "b"}, "needs a cross-encoder"),
    ("/classify", {"input": []}, "input must not be empty"),
])
def test_what_a_classifier_cannot_do_is_a_400_that_says_why(classifier, path, body, message):
    url, _ = classifier
    reply = post(url, path, **body)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]


def test_a_cross_encoder_scores_each_pair_as_one_prompt(cross_encoder):
    url, engine = cross_encoder
    want = [out.outputs.score for out in engine.score(QUERY, DOCUMENTS, use_tqdm=False)]
    reply = post(url, "/score", text_1=QUERY, text_2=DOCUMENTS)
    assert reply.status_code == 200, reply.text
    assert [d["score"] for d in reply.json()["data"]] == pytest.approx(want, abs=1e-5)
    pair_tokens = sum(len(engine.tokenizer(QUERY, document)["input_ids"]) for document in DOCUMENTS)
    assert reply.json()["usage"]["prompt_tokens"] == pair_tokens
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = post(url, path, query=QUERY, documents=DOCUMENTS, top_n=2).json()
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [r["index"] for r in ranked["results"]] == order
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[i] for i in order], abs=1e-5)
        assert ranked["results"][0]["document"]["text"] == DOCUMENTS[order[0]]
        assert ranked["usage"] == {"prompt_tokens": pair_tokens, "total_tokens": pair_tokens}  # vLLM's both
    # truncate_prompt_tokens truncates each pair as the engine does (the tokenizer's pair truncation).
    short = [out.outputs.score for out in engine.score(QUERY, DOCUMENTS, truncate_prompt_tokens=9, use_tqdm=False)]
    reply = post(url, "/score", text_1=QUERY, text_2=DOCUMENTS, truncate_prompt_tokens=9).json()
    assert [d["score"] for d in reply["data"]] == pytest.approx(short, abs=1e-5) and short != pytest.approx(want)
    assert reply["usage"]["prompt_tokens"] == 9 * len(DOCUMENTS)


def test_a_causal_lm_refuses_classify(real_server):
    reply = post(real_server.url, "/classify", model=REAL_MODEL, input="Hi")
    assert reply.status_code == 401  # the real server wants its API key, as on every /v1/ route
    from tests.server.helpers import API_KEY

    reply = httpx.post(real_server.url + "/classify", json={"input": "Hi"}, timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 400 and "no classification head" in reply.json()["error"]["message"]
