"""The job file: paths relative to it, unknown keys and bad values named, engine options handed over as given."""

import inspect
import logging

import pytest

from jaxserve.batch.job_config import EngineOptions, load_job
from jaxserve.batch.problems import JobError
from jaxserve.cli import main as cli
from jaxserve.config import MeshShape
from tests.batch.helpers import completion_line, write_job


def problems_of(path):
    with pytest.raises(JobError) as error:
        load_job(path)
    return error.value.problems


def test_relative_paths_resolve_against_the_job_file(tmp_path, monkeypatch):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    path = write_job(jobs, [completion_line("a", "x")], errors="errors.jsonl")
    monkeypatch.chdir(tmp_path)  # somewhere else than the job file
    job = load_job("jobs/job.yaml")
    assert (job.input, job.output, job.errors) == (jobs / "input.jsonl", jobs / "out.jsonl", jobs / "errors.jsonl")
    assert job.model is None and job.sampling == {} and job.engine.engine_kwargs() == {}
    assert path.exists()


def test_local_model_file_resolves_and_must_exist(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert load_job(write_job(tmp_path, [], model="m.gguf")).model == str(tmp_path / "m.gguf")
    assert load_job(write_job(tmp_path, [], model="org/hub-model")).model == "org/hub-model"
    [problem] = problems_of(write_job(tmp_path, [], model="./missing.gguf"))
    assert "model file" in problem and "missing.gguf" in problem and "does not exist" in problem


def test_an_adapter_named_as_the_model_is_refused(tmp_path):
    """Bodies naming the model would get the adapter: refused before the model loads."""
    (tmp_path / "adapter").mkdir()
    engine = {"lora_modules": {"org/hub-model": "adapter"}}
    [problem] = problems_of(write_job(tmp_path, [], model="org/hub-model", engine=engine))
    assert "the LoRA adapter 'org/hub-model' has the served model's name" in problem
    [problem] = problems_of(write_job(tmp_path, [], served_model_name="m", engine={"lora_modules": {"m": "adapter"}}))
    assert "'m' has the served model's name" in problem
    assert load_job(write_job(tmp_path, [], served_model_name="m", engine={"lora_modules": {"a": "adapter"}}))


def test_unknown_engine_key_is_named_with_the_valid_ones(tmp_path):
    [problem] = problems_of(write_job(tmp_path, [], engine={"max_num_seq": 8}))
    assert "unknown key 'engine.max_num_seq'" in problem and "max_num_seqs" in problem
    [problem] = problems_of(write_job(tmp_path, [], outputs="x.jsonl"))
    assert "unknown key 'outputs'" in problem and "output" in problem
    for value in (5, ["a"]):  # a path's key given another kind of value: named, not a TypeError traceback
        [problem] = problems_of(write_job(tmp_path, [], engine={"tokenizer": value}))
        assert "engine.tokenizer" in problem and "must be a path or hub id (text)" in problem


def test_vllm_s_options_without_effect_are_taken_with_a_warning(tmp_path, caplog):
    """As Engine takes them: an engine section copied from a vLLM script loads, each such option named."""
    with caplog.at_level(logging.WARNING, "jaxserve.engine"):
        job = load_job(write_job(tmp_path, [], engine={"trust_remote_code": True, "enforce_eager": False,
                                                       "max_num_seqs": 8}))
    assert job.engine.engine_kwargs() == {"max_num_seqs": 8}
    assert caplog.messages == ["engine.trust_remote_code has no effect in jaxserve: jaxserve runs no code from model "
                               "repositories (its models are its own)"]  # enforce_eager false: left unset
    [problem] = problems_of(write_job(tmp_path, [], engine={"task": "reward"}))
    assert "task reward is not supported" in problem


def test_every_problem_is_reported_and_the_message_is_one_line(tmp_path):
    path = write_job(tmp_path, [], engine={"max_num_seqs": 0, "mesh": "2by1", "dtype": "float16"},
                     max_concurrency=-1)
    with pytest.raises(JobError) as error:
        load_job(path)
    problems = error.value.problems
    assert len(problems) == 4
    assert any(p.startswith("engine.max_num_seqs:") and "positive integer" in p for p in problems)
    assert any(p.startswith("engine.mesh:") and "TPxPP" in p for p in problems)
    assert any(p.startswith("engine.dtype:") and "'float16'" in p for p in problems)
    assert any(p.startswith("max_concurrency:") for p in problems)
    message = str(error.value)
    assert "\n" not in message and str(path) in message and "3 more" in message and "--validate" in message


def test_missing_keys_missing_files_and_clashing_paths(tmp_path):
    (tmp_path / "only.yaml").write_text("engine: {}\n")
    assert sorted(problems_of(tmp_path / "only.yaml")) == ["`input` is required", "`output` is required"]
    (tmp_path / "paths.yaml").write_text("input: nope.jsonl\noutput: no/dir/out.jsonl\n")
    problems = problems_of(tmp_path / "paths.yaml")
    assert any("input file" in p and "nope.jsonl" in p for p in problems)
    assert any("output directory" in p and "create it" in p for p in problems)
    [problem] = problems_of(write_job(tmp_path, [], output="input.jsonl"))
    assert "output is the input file" in problem
    [problem] = problems_of(write_job(tmp_path, [], errors="out.jsonl"))
    assert "errors and output are the same file" in problem
    (tmp_path / "results").mkdir()
    [problem] = problems_of(write_job(tmp_path, [], output="results"))
    assert "output" in problem and "is a directory; give a file path" in problem
    (tmp_path / "linked.jsonl").hardlink_to(tmp_path / "input.jsonl")  # the input under another name
    [problem] = problems_of(write_job(tmp_path, [], output="linked.jsonl"))
    assert "output is the input file" in problem


def test_sampling_defaults_are_checked_like_request_bodies(tmp_path):
    [problem] = problems_of(write_job(tmp_path, [], sampling={"temprature": 0}))
    assert "unknown key 'sampling.temprature'" in problem and "temperature" in problem
    [problem] = problems_of(write_job(tmp_path, [], sampling={"top_p": 2}))
    assert problem.startswith("sampling: top_p")
    [problem] = problems_of(write_job(tmp_path, [], sampling={"stream": True}))
    assert "sampling.stream" in problem and "cannot be a job-wide default" in problem
    [problem] = problems_of(write_job(tmp_path, [], sampling={"request_id": "x"}))
    assert "sampling.request_id" in problem and "cannot be a job-wide default" in problem
    assert load_job(write_job(tmp_path, [], sampling={"temperature": 0, "max_tokens": 4, "echo": True})).sampling


def test_yaml_errors_and_non_mappings(tmp_path):
    (tmp_path / "bad.yaml").write_text("input: a\n  output: [\n")
    [problem] = problems_of(tmp_path / "bad.yaml")
    assert problem.startswith("not valid YAML at line")
    (tmp_path / "list.yaml").write_text("- a\n")
    assert "must be a mapping" in problems_of(tmp_path / "list.yaml")[0]
    with pytest.raises(JobError) as error:
        load_job(tmp_path / "absent.yaml")
    assert str(error.value) == f"job file {tmp_path / 'absent.yaml'}: no such file; check the path"


def test_engine_options_map_onto_engine_keywords():
    options = EngineOptions(mesh="2x1", max_num_seqs=8, dtype="float32", layer_loop="unrolled", kv_cache_dtype="fp8",
                            chat_template_content_format="openai")
    assert options.engine_kwargs() == {"mesh": MeshShape(2, 1), "max_num_seqs": 8, "dtype": "float32", "layer_loop": "unrolled",
                                       "kv_cache_dtype": "fp8", "chat_template_content_format": "openai"}
    with pytest.raises(ValueError, match="chat_template_content_format"):
        EngineOptions(chat_template_content_format="parts")
    assert EngineOptions(tensor_parallel_size=4).engine_kwargs() == {"mesh": MeshShape(4, 1)}
    with pytest.raises(ValueError, match="not both"):
        EngineOptions(mesh="2x1", pipeline_parallel_size=2).engine_kwargs()


def test_speculative_config_is_checked_in_the_job_file(tmp_path):
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    assert load_job(write_job(tmp_path, [], engine={"speculative_config": ngram})).engine.engine_kwargs() == \
        {"speculative_config": ngram}
    [problem] = problems_of(write_job(tmp_path, [], engine={"speculative_config": {"method": "mtp"}}))
    assert problem.startswith("engine.speculative_config:") and "method 'mtp'" in problem


def test_vllm_memory_name_and_a_chat_template_file_beside_the_job(tmp_path):
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    job = load_job(write_job(tmp_path, [], engine={"gpu_memory_utilization": 0.7, "chat_template": "chat.jinja"}))
    assert job.engine.engine_kwargs() == {"kv_cache_memory_fraction": 0.7,
                                          "chat_template": str(tmp_path / "chat.jinja")}
    broken = write_job(tmp_path, [], name="broken.yaml", engine={"chat_template": "{% if %}"})
    assert any("not valid Jinja" in problem for problem in problems_of(broken))


def test_every_engine_option_is_an_engine_keyword():
    from jaxserve.engine import Engine

    engine_keywords = set(inspect.signature(Engine.__init__).parameters)
    folded_into_mesh = {"tensor_parallel_size", "pipeline_parallel_size"}
    replicas_of_the_engine = {"data_parallel_size"}  # how many Engines, not one's keyword (async_engine/data_parallel.py)
    assert set(EngineOptions.model_fields) - folded_into_mesh - replicas_of_the_engine <= engine_keywords


def test_cli_reports_a_bad_job_in_one_line(tmp_path, capsys):
    path = write_job(tmp_path, [], engine={"max_num_seq": 8})
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["batch", str(path)])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("jaxserve: error: job file") and "unknown key 'engine.max_num_seq'" in line


def test_processes_compare_the_engine_options_as_written_one_key_each(tmp_path):
    """A multi-node job: the same file in another directory on each node agrees; a differing option is named;
    the chat template (process 0's alone) and the compilation cache and download directory (each node's own) may
    differ."""
    from jaxserve.cli.batch_cluster import shared_options

    engine = {"mesh": "4x2", "max_num_seqs": 8, "chat_template": "a.jinja", "compilation_cache_dir": "/here",
              "download_dir": "/here"}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    here = write_job(tmp_path / "a", [], model="./model.gguf", engine=engine)
    there = write_job(tmp_path / "b", [], model="./model.gguf", engine={**engine, "chat_template": "b.jinja",
                                                                          "compilation_cache_dir": "/there",
                                                                          "download_dir": "/there"})
    assert shared_options(here) == shared_options(there) == {"model": "./model.gguf", "engine.mesh": "4x2",
                                                              "engine.max_num_seqs": 8}
