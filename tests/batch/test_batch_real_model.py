"""Acceptance on the real default model (SmolLM2): a job of 29 lines mixing completions and chat, SIGKILLed
midway and re-run, ends with one line per custom_id and the same answers as an uninterrupted run; and a batch
line answers exactly as the HTTP API does."""

import signal
import subprocess
import sys
import time

import pytest

from jaxserve import BeamSearchParams
from jaxserve.batch.job import run_job
from tests.batch.helpers import (
    SMALL_ENGINE,
    answers_over_http,
    chat_line,
    completion_line,
    embedding_line,
    pooled_line,
    read_jsonl,
    results_by_custom_id,
    write_job,
)

SAMPLING = {"temperature": 0, "max_tokens": 8}
# A few lines in the engine at once, so that the killed run writes its results a few at a time.
MAX_CONCURRENCY = 8
LINES = (
    [completion_line(f"cmpl-{index}", f"Fact number {index} about the ocean:") for index in range(12)]
    + [chat_line(f"chat-{index}", f"Say something short about the number {index}.") for index in range(10)]
    + ["{this line is not JSON", completion_line("too-long", "word " * 600)]
    + [embedding_line("embd-0", ["The ocean is deep.", "Numbers are fun."]), embedding_line("embd-1", [1, 2, 3])]
    + [completion_line("beams", "The capital of France is", n=2, use_beam_search=True)]
    + [pooled_line("score", "/v1/score", text_1="The ocean is deep.", text_2=["The sea is deep.", "I like tea."]),
       pooled_line("rerank", "/v1/rerank", query="deep water", documents=["A cup of tea.", "The deep ocean."])]
)


def line_of(custom_id: str) -> dict:
    return next(line for line in LINES if isinstance(line, dict) and line["custom_id"] == custom_id)


def job_in(directory, model_path):
    directory.mkdir()
    return write_job(directory, LINES, model=model_path, engine=SMALL_ENGINE, sampling=SAMPLING,
                     max_concurrency=MAX_CONCURRENCY)


@pytest.fixture(scope="module")
def engine(smollm2_gguf_path):
    from jaxserve import Engine

    return Engine(smollm2_gguf_path, **SMALL_ENGINE)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, engine, smollm2_gguf_path):
    """custom_id -> (status, body minus id/created) of the whole job run in one go."""
    job = job_in(tmp_path_factory.mktemp("uninterrupted") / "job", smollm2_gguf_path)
    summary = run_job(job, engine=engine, show_progress=False)
    assert (summary.total, summary.totals.succeeded, summary.totals.failed) == (len(LINES), len(LINES) - 2, 2)
    return results_by_custom_id(job.parent / "out.jsonl")


def start_batch(job):
    return subprocess.Popen([sys.executable, "-m", "jaxserve.cli.main", "batch", str(job), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_midway(process, output, at_least=6, timeout=300):
    """SIGKILL the job once some (not all) of its results are on disk; returns how many were."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        done = len(output.read_text().splitlines()) if output.exists() else 0
        if done >= at_least:
            process.send_signal(signal.SIGKILL)
            process.wait()
            return done
        time.sleep(0.05)
    process.kill()
    pytest.fail(f"the job ended or stalled before it could be killed midway:\n{process.communicate()[0][-3000:]}")


def test_killed_and_rerun_job_equals_an_uninterrupted_one(tmp_path, smollm2_gguf_path, uninterrupted):
    job = job_in(tmp_path / "job", smollm2_gguf_path)
    output = job.parent / "out.jsonl"
    done_at_kill = kill_midway(start_batch(job), output)
    lines_at_kill = len(output.read_text().splitlines())
    assert lines_at_kill < len(LINES), "the job finished before the kill: nothing was resumed"
    succeeded_at_kill = sum(record["error"] is None for record in read_jsonl(output))  # the failures run again
    with output.open("a") as out:
        out.write('{"id": "batch_req_torn", "custom_id": "chat-')  # the torn write a kill can leave
    rerun = start_batch(job)
    log = rerun.communicate(timeout=600)[0]
    assert rerun.returncode == 0, log[-3000:]
    assert f"resuming: {succeeded_at_kill} of {len(LINES)} lines already have results" in log and "torn line" in log
    assert done_at_kill >= 6 and results_by_custom_id(output) == uninterrupted
    assert len(read_jsonl(output)) == len(LINES)


def test_refused_and_malformed_lines_become_error_records(uninterrupted):
    status, body = uninterrupted["too-long"]
    assert status == 400 and "maximum context length is 512" in body["error"]["message"]
    bad = LINES.index("{this line is not JSON") + 1
    assert uninterrupted[None] == (None, f"line {bad} is not valid JSON: Expecting property name enclosed in double "
                                         "quotes: line 1 column 2 (char 1)")


def test_same_body_as_the_http_api(engine, uninterrupted):
    # completion, chat, refusal, embeddings, beams, score, rerank
    lines = [line_of(custom_id) for custom_id in ("cmpl-0", "chat-2", "too-long", "embd-0", "beams", "score", "rerank")]
    http = answers_over_http(engine, lines, SAMPLING, [engine.model_name])
    assert http == {line["custom_id"]: uninterrupted[line["custom_id"]] for line in lines}
    assert http["cmpl-0"][1]["choices"][0]["text"] and http["chat-2"][1]["choices"][0]["message"]["content"]
    expected = engine.embed(line_of("embd-0")["body"]["input"], use_tqdm=False)
    assert [d["embedding"] for d in http["embd-0"][1]["data"]] == [e.outputs.embedding for e in expected]
    [beams] = engine.beam_search(["The capital of France is"], BeamSearchParams(beam_width=2, max_tokens=8),
                                 use_tqdm=False)
    assert [choice["text"] for choice in http["beams"][1]["choices"]] == \
        [engine.tokenizer.decode(seq.generated_ids, skip_special_tokens=True) for seq in beams.sequences]
    scores = engine.score("The ocean is deep.", ["The sea is deep.", "I like tea."], use_tqdm=False)
    assert [d["score"] for d in http["score"][1]["data"]] == [[s.outputs.score] for s in scores]
    documents = line_of("rerank")["body"]["documents"]
    relevance = [s.outputs.score for s in engine.score("deep water", documents, use_tqdm=False)]
    ranked = http["rerank"][1]["results"]
    assert [r["index"] for r in ranked] == sorted(range(2), key=lambda i: -relevance[i])
    assert [r["relevance_score"] for r in ranked] == [[relevance[r["index"]]] for r in ranked]
    assert [r["document"]["text"] for r in ranked] == [documents[r["index"]] for r in ranked]
