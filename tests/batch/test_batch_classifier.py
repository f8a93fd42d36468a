"""Batch lines to a sequence classifier: /v1/classify, and the cross-encoder's /score and /rerank under every
spelling the server answers at, give the bodies HTTP gives; a generation line is refused as over HTTP."""

import pytest

from jaxserve.batch.job import run_job
from tests.batch.helpers import (
    SMALL_ENGINE,
    answers_over_http,
    completion_line,
    pooled_line,
    results_by_custom_id,
    write_job,
)
from tests.helpers import make_tiny_classifier

QUERY, DOCUMENTS = "Where is the Eiffel Tower?", ["It stands in Paris.", "Bananas are yellow."]
LINES = [pooled_line("classify", "/v1/classify", input=["Good food.", "Bad weather."]),
         pooled_line("classify-ids", "/classify", input=[5, 6, 7]),
         pooled_line("score", "/score", text_1=QUERY, text_2=DOCUMENTS),
         pooled_line("score-v1", "/v1/score", text_1=[QUERY, QUERY], text_2=DOCUMENTS),
         pooled_line("rerank", "/rerank", query=QUERY, documents=DOCUMENTS),
         pooled_line("rerank-v2", "/v2/rerank", query=QUERY, documents=DOCUMENTS, top_n=1),
         completion_line("generate", "Hello")]


@pytest.fixture(scope="module")
def cross_encoder(tiny_checkpoint, tmp_path_factory):
    from jaxserve import Engine

    path = tmp_path_factory.mktemp("cross-encoder")
    make_tiny_classifier(tiny_checkpoint("qwen3"), path, 1)
    return path, Engine(str(path), dtype="float32", **SMALL_ENGINE)


def test_classifier_lines_give_the_http_bodies(cross_encoder, tmp_path):
    path, engine = cross_encoder
    job = write_job(tmp_path, LINES, model=str(path), engine=SMALL_ENGINE)
    summary = run_job(job, engine=engine, show_progress=False)
    assert (summary.total, summary.totals.succeeded, summary.totals.failed) == (7, 6, 1)
    batch = results_by_custom_id(tmp_path / "out.jsonl")
    status, error = batch["generate"]
    assert status == 400 and "is a sequence classifier" in error["error"]["message"]
    assert answers_over_http(engine, LINES, {}, [engine.model_name]) == batch
    scores = [out.outputs.score for out in engine.score(QUERY, DOCUMENTS, use_tqdm=False)]
    assert [d["score"] for d in batch["score"][1]["data"]] == [[score] for score in scores]
    assert [r["index"] for r in batch["rerank-v2"][1]["results"]] == [max(range(2), key=lambda i: scores[i])]
    probs = [out.outputs.probs for out in engine.classify(["Good food.", "Bad weather."], use_tqdm=False)]
    assert [d["probs"] for d in batch["classify"][1]["data"]] == probs
