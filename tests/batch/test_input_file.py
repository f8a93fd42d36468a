"""Reading the input JSONL: malformed lines named by number, blank lines skipped, duplicate custom_ids found."""

import pytest

from jaxserve.batch.input_file import BadLine, InputItem, scan_input
from jaxserve.batch.job import run_job
from jaxserve.batch.problems import JobError
from tests.batch.helpers import chat_line, completion_line, write_job, write_jsonl


def test_good_and_malformed_lines(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        completion_line("a", "hello"),
        "",
        "{not json",
        "[1, 2]",
        {"method": "POST", "url": "/v1/completions", "body": {}},
        {**chat_line("b", "hi"), "url": "/v1/audio/transcriptions"},
        {**chat_line("c", "hi"), "method": "GET"},
        {**completion_line("d", "x"), "body": "prompt"},
        {**completion_line("e", "x"), "custom_id": 5},
        chat_line("f", "hi"),
    ])
    scan = scan_input(path)
    assert [(item.line, item.custom_id, item.url) for item in scan.items] == [
        (1, "a", "/v1/completions"), (10, "f", "/v1/chat/completions")]
    bad = {entry.line: entry for entry in scan.bad_lines}
    assert sorted(bad) == [3, 4, 5, 6, 7, 8, 9]
    assert bad[3].message.startswith("line 3 is not valid JSON")
    assert "expected a JSON object" in bad[4].message and "got list" in bad[4].message
    assert bad[5].message == "line 5: `custom_id` is required" and bad[5].custom_id is None
    assert "url" in bad[6].message and "/v1/audio/transcriptions" in bad[6].message and bad[6].custom_id == "b"
    assert "method" in bad[7].message and "'GET'" in bad[7].message
    assert bad[8].message.startswith("line 8: body:")
    assert bad[9].message.startswith("line 9: custom_id:") and bad[9].key == 9  # no usable id: keyed by line
    assert [type(entry) for entry in scan.entries] == [InputItem] + [BadLine] * 7 + [InputItem]
    assert scan.count_by_url() == {"/v1/completions": 1, "/v1/chat/completions": 1}
    assert scan.duplicates == []


def test_duplicate_custom_ids_are_named_with_both_lines(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [completion_line("a", "x"), completion_line("b", "x"),
                                               chat_line("a", "y"), {**completion_line("b", 1)}])
    assert scan_input(path).duplicates == [
        "custom_id 'a' appears on lines 1 and 3; each request needs its own",
        "custom_id 'b' appears on lines 2 and 4; each request needs its own"]


def test_duplicates_refuse_the_job_before_anything_runs(tmp_path):
    path = write_job(tmp_path, [completion_line("a", "x"), chat_line("a", "y")])
    with pytest.raises(JobError, match="custom_id 'a' appears on lines 1 and 2"):
        run_job(path, engine=object())  # an engine it must never touch
    assert not (tmp_path / "out.jsonl").exists()
