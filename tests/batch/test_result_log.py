"""Result files: a torn last line (from a kill) is cut off, anything else foreign is refused, writers exclude."""

import json

import pytest

from jaxserve.batch.input_file import BadLine
from jaxserve.batch.records import bad_line, refused, succeeded
from jaxserve.batch.result_log import ResultLog, read_results
from jaxserve.errors import UserError
from jaxserve.server.errors import bad_request


def write_records(path, *records):
    with ResultLog(path, None) as log:
        for record in records:
            log.write(record)


def test_results_are_keyed_by_custom_id_or_line(tmp_path):
    out = tmp_path / "out.jsonl"
    write_records(out, succeeded("a", "cmpl-1", {"x": 1}), bad_line(BadLine(7, None, "line 7: bad")),
                  refused("b", "cmpl-2", bad_request("too long")))
    first, second, third = (json.loads(line) for line in out.read_text().splitlines())
    assert first["response"] == {"status_code": 200, "request_id": "cmpl-1", "body": {"x": 1}}
    assert first["error"] is None and first["id"].startswith("batch_req_")
    assert second["response"] is None and second["error"]["line"] == 7
    assert third["response"]["status_code"] == 400 and third["response"]["body"]["error"]["message"] == "too long"
    assert third["error"]["message"] == "too long"


@pytest.mark.parametrize("tail", [b'{"id": "batch_req_x", "custom_id": "c", "resp', b"\x00\x00\x00\n",
                                  json.dumps({"id": "r", "custom_id": "c"}).encode()])
def test_a_torn_last_line_is_dropped(tmp_path, tail):
    out = tmp_path / "out.jsonl"
    write_records(out, succeeded("a", "cmpl-1", {}), succeeded("b", "cmpl-2", {}))
    intact = out.read_bytes()
    out.write_bytes(intact + tail)
    assert read_results(out).keys == {"a", "b"} and out.read_bytes() == intact + tail  # reading alone changes nothing
    with ResultLog(out, None) as log:
        assert log.done == {"a", "b"}
        log.write(succeeded("c", "cmpl-3", {}))
    lines = out.read_text().splitlines()
    assert out.read_bytes().startswith(intact) and [json.loads(line)["custom_id"] for line in lines] == ["a", "b", "c"]


def test_a_foreign_line_before_the_end_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("hello\n" + succeeded("a", "cmpl-1", {}).model_dump_json() + "\n")
    with pytest.raises(UserError, match="line 1 of .* is not a batch result line"):
        ResultLog(out, None)


@pytest.mark.parametrize("content", ['{"custom_id": "q1", "body": {"prompt": "x"}}\n', "just some notes"])
def test_a_file_of_anything_else_is_refused_and_left_as_it_was(tmp_path, content):
    """Another job's input, say, named as the output by mistake: its last line is no torn result (a kill never
    finishes a line it did not write whole, and a torn one begins as every record does), so nothing is dropped."""
    out = tmp_path / "out.jsonl"
    out.write_text(content)
    with pytest.raises(UserError, match="line 1 of .* is not a batch result line"):
        ResultLog(out, None)
    assert out.read_text() == content


def test_failures_go_to_the_errors_file_when_set(tmp_path):
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    with ResultLog(out, errors) as log:
        log.write(succeeded("a", "cmpl-1", {}))
        log.write(refused("b", "cmpl-2", bad_request("no")))
        log.write(bad_line(BadLine(3, None, "line 3: bad")))
    assert len(out.read_text().splitlines()) == 1 and len(errors.read_text().splitlines()) == 2


def test_a_rerun_runs_the_failed_lines_again_and_keeps_one_record_a_line(tmp_path):
    """A job re-run after its failures were fixed (a model name, a body) runs those lines again: their records
    are taken out first, the successes kept as written."""
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    write_records(out, succeeded("a", "cmpl-1", {"x": 1}), refused("b", "cmpl-2", bad_request("no")),
                  bad_line(BadLine(7, None, "line 7: bad")))
    first_line = out.read_text().splitlines()[0]
    with ResultLog(out, None) as log:
        assert (log.done, log.retried) == ({"a"}, 2)
        log.write(succeeded("b", "cmpl-3", {"x": 2}))
    lines = out.read_text().splitlines()
    assert lines[0] == first_line and [json.loads(line)["custom_id"] for line in lines] == ["a", "b"]
    assert not (tmp_path / "out.jsonl.retrying").exists()
    with ResultLog(out, errors) as log:  # with an errors file, the failures there run again too
        log.write(refused("c", "cmpl-4", bad_request("no")))
    with ResultLog(out, errors) as log:
        assert (log.done, log.retried) == ({"a", "b"}, 1) and errors.read_text() == ""


def test_a_second_writer_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    with ResultLog(out, None):
        with pytest.raises(UserError, match="another `jaxserve batch` is writing"):
            ResultLog(out, None)
