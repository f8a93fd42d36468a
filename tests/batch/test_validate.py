"""`jaxserve batch --validate`: counts and every problem, without loading the model (or even jax)."""

import subprocess
import sys

from jaxserve.batch.records import succeeded
from jaxserve.batch.result_log import ResultLog
from jaxserve.cli import main as cli
from tests.batch.helpers import chat_line, completion_line, write_job

GOOD = [completion_line("a", "Hello"), chat_line("b", "Hi"), completion_line("c", ["x", "y"])]


def validate(capsys, path):
    try:
        code = cli.main(["batch", "--validate", str(path)])
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_good_job(tmp_path, capsys):
    path = write_job(tmp_path, GOOD, sampling={"max_tokens": 4})
    code, out, err = validate(capsys, path)
    assert code == 0 and err == ""
    assert "3 lines, 3 requests (2 /v1/completions, 1 /v1/chat/completions), 0 malformed" in out
    assert "nothing done yet" in out and "no problems found" in out
    with ResultLog(tmp_path / "out.jsonl", None) as log:
        log.write(succeeded("b", "chatcmpl-1", {}))
    assert "1 of 3 lines already done" in validate(capsys, path)[1]


def test_every_problem_is_listed(tmp_path, capsys):
    lines = [*GOOD, "oops", chat_line("a", "again"), completion_line("d", "x", temperature=-1),
             chat_line("e", "x", model="other"), {"custom_id": "f", "method": "POST", "url": "/v1/completions"}]
    path = write_job(tmp_path, lines, served_model_name="mine")
    code, out, err = validate(capsys, path)
    assert code == 2 and err.strip() == f"jaxserve: error: 5 problem(s) in {path}; see the list above"
    assert "5 problem(s):" in out and "8 lines, 6 requests" in out and "2 malformed" in out
    for expected in ("line 4 is not valid JSON", "custom_id 'a' appears on lines 1 and 5",
                     "line 6 (custom_id 'd'): temperature", "line 7 (custom_id 'e'): model 'other' is not served",
                     "line 8: `body` is required"):
        assert expected in out, expected


def test_model_names_are_checked_against_the_name_the_job_serves(tmp_path, capsys):
    """Without served_model_name the model serves under its own name (the default model's here): an OpenAI batch
    file's model names would make every line a 404 record, so --validate lists them."""
    lines = [completion_line("a", "x", model="SmolLM2-135M-Instruct"), completion_line("b", "x", model="gpt-4o-mini")]
    code, out, _ = validate(capsys, write_job(tmp_path, lines))
    assert code == 2 and "1 problem(s):" in out
    assert ("line 2 (custom_id 'b'): model 'gpt-4o-mini' is not served; the job serves its model as "
            "'SmolLM2-135M-Instruct' (set served_model_name to the name the bodies use)") in out
    assert validate(capsys, write_job(tmp_path, lines, served_model_name=["gpt-4o-mini", "SmolLM2-135M-Instruct"]))[0] == 0


def test_a_bad_job_file_is_listed_too(tmp_path, capsys):
    code, out, _ = validate(capsys, write_job(tmp_path, GOOD, engine={"tp": 2}, max_concurency=4))
    assert code == 2 and "unknown key 'engine.tp'" in out and "unknown key 'max_concurency'" in out


def test_validate_does_not_import_jax(tmp_path):
    path = write_job(tmp_path, GOOD)
    script = ("import sys\nfrom jaxserve.cli.main import main\nassert main(['batch', '--validate', sys.argv[1]]) == 0\n"
              "assert 'jax' not in sys.modules, 'validate imported jax'\n")
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
