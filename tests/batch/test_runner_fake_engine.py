"""The batch runner over the fake engine (no model, milliseconds): every kind of line gets exactly the HTTP API's
answer, failures become records and the job goes on, and an interrupted job resumes without loss."""

from types import SimpleNamespace

import pytest

from jaxserve.batch.job import run_job
from tests.batch.helpers import (
    answers_over_http,
    chat_line,
    completion_line,
    embedding_line,
    read_jsonl,
    results_by_custom_id,
    write_job,
)
from tests.server.fake_engine import FakeEngine
from tests.server.test_tool_parsers import REPLY
from tests.server.test_tools import TOOLS

SAMPLING = {"temperature": 0, "max_tokens": 5}
LINES = [
    completion_line("plain", "Hello there"),
    chat_line("chat", "Hi!", model="fake-model"),
    completion_line("two-prompts", ["First prompt", "Second"], n=2, temperature=1.0, seed=3),
    completion_line("echo-logprobs", "Count: one", echo=True, logprobs=2, max_tokens=3),
    chat_line("chat-logprobs", "Hey", logprobs=True, top_logprobs=2, stop=[" four"]),
    completion_line("token-ids", [1, 2, 3], max_tokens=2),
    completion_line("too-long", "word " * 300, max_tokens=100),
    completion_line("bad-value", "x", top_p=5),
    completion_line("bad-type", "x", max_tokens="many"),
    chat_line("unknown-model", "x", model="gpt-4o"),
    {"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "fake-model"}},
    completion_line("beams", ["Hello there", "Second"], n=2, use_beam_search=True, max_tokens=3),
    chat_line("chat-beams", "Hi!", n=3, use_beam_search=True),
    completion_line("beams-stop", "x", n=2, use_beam_search=True, stop=["a"]),
]


def test_every_line_answers_as_the_http_api_does(tmp_path, fake_engine):
    summary = run_job(write_job(tmp_path, LINES, sampling=SAMPLING), engine=fake_engine, show_progress=False)
    assert (summary.total, summary.totals.succeeded, summary.totals.failed) == (14, 8, 6)
    batch = results_by_custom_id(tmp_path / "out.jsonl")
    http = answers_over_http(fake_engine, LINES, SAMPLING, ["fake-model"])
    assert batch == http
    assert {custom_id: status for custom_id, (status, _) in batch.items() if status != 200} == {
        "too-long": 400, "bad-value": 400, "bad-type": 400, "unknown-model": 404, "no-messages": 400,
        "beams-stop": 400}
    assert [choice["index"] for choice in batch["two-prompts"][1]["choices"]] == [0, 1, 2, 3]
    assert [choice["index"] for choice in batch["beams"][1]["choices"]] == [0, 1, 2, 3]  # 2 prompts x 2 beams
    assert len(batch["chat-beams"][1]["choices"]) == 3


def test_error_records_carry_the_message_and_the_job_goes_on(tmp_path, fake_engine):
    lines = [completion_line("ok", "Hello"), "{broken", completion_line("long", "word " * 300, max_tokens=100),
             {**completion_line("streamed", "x"), "body": {"prompt": "x", "stream": True}},
             {**completion_line("named", "x"), "body": {"prompt": "x", "request_id": "mine"}},
             chat_line("last", "Hi")]
    run_job(write_job(tmp_path, lines, sampling=SAMPLING, errors="errors.jsonl"), engine=fake_engine,
            show_progress=False)
    assert sorted(record["custom_id"] for record in read_jsonl(tmp_path / "out.jsonl")) == ["last", "ok"]
    errors = {record["custom_id"]: record for record in read_jsonl(tmp_path / "errors.jsonl")}
    assert errors[None]["error"] == {"code": "invalid_request_line", "line": 2, "param": None,
                                     "message": errors[None]["error"]["message"]}
    assert errors[None]["error"]["message"].startswith("line 2 is not valid JSON") and errors[None]["response"] is None
    long = errors["long"]
    assert long["response"]["status_code"] == 400 and "maximum context length" in long["error"]["message"]
    assert long["response"]["body"]["error"]["message"] == long["error"]["message"]
    assert long["response"]["request_id"].startswith("cmpl-")
    assert "stream is not supported" in errors["streamed"]["error"]["message"]
    # the HTTP API's response id; a line's result is found by its custom_id
    assert errors["named"]["error"]["param"] == "request_id"


def test_lines_the_http_server_refuses_as_unreadable_are_error_records_too(tmp_path, fake_engine, monkeypatch):
    """A lone surrogate escape, nesting too deep, an integer too long to read, or a line failing where nothing
    expected: each line is its own error record and the job finishes (it stopped at the same line on every
    rerun, so it could never finish)."""
    deep = "[" * 100_000 + "]" * 100_000
    lines = [completion_line("ok", "Hello"),
             '{"custom_id": "s", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a \\ud800"}}',
             '{"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": ' + deep + '}}',
             '{"custom_id": "i", "method": "POST", "url": "/v1/completions", "body": {"seed": ' + "9" * 5000 + '}}',
             completion_line("odd", "fails oddly"), chat_line("last", "Hi")]
    prepare = fake_engine.prepare_request

    def failing(request_id, prompt, params, **kw):
        if prompt == "fails oddly":
            raise TypeError("something nobody expected")
        return prepare(request_id, prompt, params, **kw)

    monkeypatch.setattr(fake_engine, "prepare_request", failing)
    summary = run_job(write_job(tmp_path, lines, sampling=SAMPLING), engine=fake_engine, show_progress=False)
    assert (summary.totals.succeeded, summary.totals.failed) == (2, 4)
    messages = [record["error"]["message"] for record in read_jsonl(tmp_path / "out.jsonl") if record["error"]]
    assert any("unpaired UTF-16 surrogate" in m for m in messages)
    assert any("nests JSON arrays or objects too deeply" in m for m in messages)
    assert any("cannot be read as JSON" in m for m in messages)
    assert any("something nobody expected" in m for m in messages)


def test_max_concurrency_bounds_the_lines_in_the_engine(tmp_path, fake_engine):
    seen = []
    step = fake_engine.step

    def counting_step():
        seen.append(len(fake_engine._running))
        return step()

    fake_engine.step = counting_step
    lines = [completion_line(f"r{index}", "Hello", max_tokens=1 + index % 4) for index in range(20)]
    run_job(write_job(tmp_path, lines, sampling=SAMPLING, max_concurrency=3), engine=fake_engine,
            show_progress=False)
    assert max(seen) == 3 and len(read_jsonl(tmp_path / "out.jsonl")) == 20


def test_an_interrupted_job_resumes_where_it_stopped(tmp_path, fake_engine):
    lines = [completion_line(f"r{index}", f"Prompt {index}", max_tokens=1 + index % 5) for index in range(30)]
    lines.insert(7, "not json")
    job = write_job(tmp_path, lines, sampling=SAMPLING, max_concurrency=4)
    real_step, steps = fake_engine.step, []

    def dying_step():
        steps.append(1)
        if len(steps) == 12:
            raise KeyboardInterrupt  # as Ctrl-C would, mid-job
        return real_step()

    fake_engine.step = dying_step
    with pytest.raises(KeyboardInterrupt):
        run_job(job, engine=fake_engine, show_progress=False)
    partial = read_jsonl(tmp_path / "out.jsonl")
    assert 0 < len(partial) < 31
    with (tmp_path / "out.jsonl").open("a") as out:
        out.write('{"id": "batch_req_torn", "custom_id": "r2')  # and a torn line, as a SIGKILL mid-write leaves
    fake_engine.step = real_step
    fake_engine._running.clear()  # the killed process's engine would be gone
    summary = run_job(job, engine=fake_engine, show_progress=False)
    kept = [record for record in partial if record["error"] is None]  # a failure's line runs again
    assert summary.skipped == len(kept) and summary.total == 31
    records = read_jsonl(tmp_path / "out.jsonl")
    assert records[:len(kept)] == kept  # successes kept as written
    keys = sorted(str(record["custom_id"] or record["error"]["line"]) for record in records)
    assert keys == sorted([f"r{index}" for index in range(30)] + ["8"])
    # done but for the line that is no request (its record is written again): the engine is not touched
    again = run_job(job, engine=object(), show_progress=False)
    assert (again.skipped, again.totals.failed) == (30, 1) and len(read_jsonl(tmp_path / "out.jsonl")) == 31


def test_a_stop_signal_ends_the_job_between_steps_with_every_finished_result_saved(tmp_path, fake_engine,
                                                                                   monkeypatch):
    """SIGTERM (a scheduler's) stops after the step in flight, never inside it; more SIGTERMs change nothing; a
    second Ctrl-C stops at once; the handlers before the job come back after it; while one process loads its model,
    a SIGTERM stops the job at once."""
    import os
    import signal

    from jaxserve.batch.stop import JobInterrupted, StopSignals

    lines = [completion_line(f"r{index}", f"Prompt {index}", max_tokens=3) for index in range(20)]
    job = write_job(tmp_path, lines, sampling=SAMPLING, max_concurrency=2)
    real_step, steps = fake_engine.step, []

    def step_then_signal():
        outputs = real_step()  # the signal lands while the step is in flight: the step still completes
        steps.append(1)
        if len(steps) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # one per follower that got a signal: ignored
        return outputs

    fake_engine.step = step_then_signal
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(JobInterrupted), StopSignals() as stop:
        run_job(job, engine=fake_engine, show_progress=False, stop=stop)
    assert len(steps) == 5 and signal.getsignal(signal.SIGTERM) is before
    saved = read_jsonl(tmp_path / "out.jsonl")
    assert 0 < len(saved) < 20 and all(record["response"]["status_code"] == 200 for record in saved)

    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested  # the first Ctrl-C only asks
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)

    # A single process loading its model has no step to finish: SIGTERM then ends the job at once
    (tmp_path / "out.jsonl").unlink()
    loaded = []

    def slow_load(job):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-load (a model taking minutes to load and compile)
        loaded.append(job)
        return fake_engine

    monkeypatch.setattr("jaxserve.batch.job.build_engines", slow_load)
    with pytest.raises(JobInterrupted), StopSignals() as stop:
        run_job(job, show_progress=False, stop=stop)
    assert loaded == [] and read_jsonl(tmp_path / "out.jsonl") == []  # stopped inside the load, nothing ran


def test_tool_choice_auto_needs_the_jobs_tool_call_parser(tmp_path, smol_tokenizer):
    engine = FakeEngine(smol_tokenizer, step_delay=0, script_text=REPLY)
    engine.config.scheduler = SimpleNamespace(max_num_seqs=4)
    line = chat_line("weather", "Weather in Paris?", tools=TOOLS, stop=["</tool_call>"],
                     include_stop_str_in_output=True, temperature=0, max_tokens=100)
    run_job(write_job(tmp_path, [line], name="plain.yaml"), engine=engine, show_progress=False)
    status, body = results_by_custom_id(tmp_path / "out.jsonl")["weather"]
    assert status == 400 and body["error"]["param"] == "tool_choice" and "tool_call_parser" in body["error"]["message"]

    (tmp_path / "out.jsonl").unlink()
    run_job(write_job(tmp_path, [line], name="tools.yaml", tool_call_parser="hermes"), engine=engine,
            show_progress=False)
    status, body = results_by_custom_id(tmp_path / "out.jsonl")["weather"]
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_the_jobs_reasoning_parser_splits_reasoning_from_the_answer(tmp_path, smol_tokenizer):
    from tests.server.test_reasoning_parsers import THINKING, THOUGHT

    engine = FakeEngine(smol_tokenizer, step_delay=0, script_text=THINKING)
    engine.config.scheduler = SimpleNamespace(max_num_seqs=4)
    line = chat_line("think", "Weather?", temperature=0, max_tokens=len(smol_tokenizer.encode(THINKING)))
    run_job(write_job(tmp_path, [line], reasoning_parser="qwen3"), engine=engine, show_progress=False)
    status, body = results_by_custom_id(tmp_path / "out.jsonl")["think"]
    assert status == 200
    assert (body["choices"][0]["message"]["reasoning"], body["choices"][0]["message"]["content"]) == \
        (THOUGHT, "\n\nIt is sunny.")


def test_cache_salt_reaches_the_engine_and_job_defaults_raise_no_ignored_field_warnings(tmp_path, fake_engine,
                                                                                        caplog):
    """A line's cache_salt keeps its prefix cache apart as over HTTP; the job's sampling defaults are applied to the
    endpoints that have them, so an embeddings or score line does not report them as fields it ignored."""
    caplog.set_level("WARNING", logger="jaxserve.server")
    lines = [completion_line("salted", "Hello there", cache_salt="tenant-a"),
             embedding_line("embed", "Hello")]
    summary = run_job(write_job(tmp_path, lines, sampling=SAMPLING), engine=fake_engine, show_progress=False)
    assert summary.totals.succeeded == 2
    assert {"prompt": "Hello there", "cache_salt": "tenant-a"} in fake_engine.prompts.values()
    assert "ignored" not in caplog.text
    # a field a body has that no endpoint reads is named with the line it is on (a job's lines share one log)
    (tmp_path / "out.jsonl").unlink()
    run_job(write_job(tmp_path, [completion_line("typo", "Hi", max_tokns=3)], sampling=SAMPLING),
            engine=fake_engine, show_progress=False)
    assert "these fields of the request on line 1 (custom_id 'typo') were ignored: max_tokns" in caplog.text


def test_a_body_field_overrides_the_defaults_of_its_group(tmp_path, fake_engine):
    """The body wins over the job's sampling defaults, also where it spells the choice otherwise: max_tokens over a
    default max_completion_tokens, a guided_choice over a default response_format (which together were a 400)."""
    sampling = {"temperature": 0, "max_completion_tokens": 3, "response_format": {"type": "json_object"}}
    lines = [chat_line("long", "Hi", max_tokens=6, response_format={"type": "text"}),
             chat_line("choice", "Hi", guided_choice=["yes", "no"]),
             chat_line("defaults", "Hi")]
    summary = run_job(write_job(tmp_path, lines, sampling=sampling), engine=fake_engine, show_progress=False)
    assert summary.totals.succeeded == 3, read_jsonl(tmp_path / "out.jsonl")
    by_id = {record["custom_id"]: record["response"]["body"] for record in read_jsonl(tmp_path / "out.jsonl")}
    assert by_id["long"]["usage"]["completion_tokens"] == 6 and by_id["defaults"]["usage"]["completion_tokens"] <= 3
    def constraint(params):
        so = params.structured_outputs
        return "none" if so is None else "choice" if so.choice else "json_object" if so.json_object else "other"

    assert sorted((p.max_tokens, constraint(p)) for p in fake_engine.sampling_params.values()) == [
        (3, "choice"), (3, "json_object"), (6, "none")]
