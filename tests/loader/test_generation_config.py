"""Sampling defaults chosen as vLLM's --generation-config and --override-generation-config choose them: the
model's generation_config.json, none, or another directory's, with overrides laid over them and checked."""

import json
import subprocess
import sys

import pytest

from jaxserve import Engine, SamplingParams
from jaxserve.batch.job_config import EngineOptions
from jaxserve.cli.args import generation_overrides
from jaxserve.loader.generation_config import generation_defaults
from jaxserve.server.chat_protocol import ChatCompletionRequest
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.request_bodies import parse_request

MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.8}


def test_the_source_then_the_overrides(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 20, "temperature": None, "do_sample": True}))
    assert generation_defaults(MODEL_DEFAULTS) == MODEL_DEFAULTS
    assert generation_defaults(MODEL_DEFAULTS, "vllm") == {}
    assert generation_defaults(MODEL_DEFAULTS, str(tmp_path)) == {"top_k": 20}  # its sampling fields, nulls skipped
    assert generation_defaults(MODEL_DEFAULTS, str(tmp_path / "generation_config.json")) == {"top_k": 20}
    assert generation_defaults(MODEL_DEFAULTS, "auto", {"temperature": 0.2, "min_p": 0.1}) == \
        {"temperature": 0.2, "top_p": 0.8, "min_p": 0.1}
    assert generation_defaults(MODEL_DEFAULTS, "vllm", {"temperature": 0.2}) == {"temperature": 0.2}
    assert MODEL_DEFAULTS == {"temperature": 0.7, "top_p": 0.8}  # the model's own are left as they were


@pytest.mark.parametrize("source, overrides, message", [
    ("nowhere", None, "generation_config='nowhere' is not one of 'auto', 'vllm' or a directory"),
    ("auto", {"max_tokens": 5}, "'max_tokens' is not a sampling default"),  # the file's name is max_new_tokens
    ("auto", {"max_new_tokens": 0}, "override_generation_config: max_tokens"),
    ("auto", {"temperature": -1}, "override_generation_config: temperature"),
    ("auto", {"top_k": "many"}, "override_generation_config: "),
])
def test_what_cannot_be_a_default_is_refused_by_name(source, overrides, message):
    with pytest.raises(ValueError, match=message):
        generation_defaults(MODEL_DEFAULTS, source, overrides)


def test_an_engine_and_a_batch_job_take_both_options(tiny_checkpoint):
    engine = Engine(str(tiny_checkpoint("llama")), generation_config="vllm", override_generation_config={"top_k": 5},
                    num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=2, warmup=False)
    assert engine.generation_defaults == {"top_k": 5}
    params = engine.default_sampling_params()
    assert (params.top_k, params.temperature, params.top_p) == (5, 1.0, 1.0)
    options = EngineOptions.model_validate({"generation_config": "vllm", "override_generation_config": {"top_k": 5}})
    assert options.engine_kwargs() == {"generation_config": "vllm", "override_generation_config": {"top_k": 5}}


def test_a_batch_jobs_generation_config_directory_is_beside_the_job_file():
    def resolved(source):
        options = EngineOptions.model_validate({"generation_config": source}, context={"base_dir": "/jobs"})
        return options.generation_config

    assert (resolved("gen"), resolved("/abs/gen"), resolved("vllm"), resolved("auto")) == \
        ("/jobs/gen", "/abs/gen", "vllm", "auto")


def test_a_bad_override_is_refused_before_anything_loads():
    run = subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "serve", "--override-generation-config",
                          '{"temprature": 0.5}'], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--override-generation-config: 'temprature' is not a sampling default" in run.stderr
    with pytest.raises(ValueError, match="'temprature' is not a sampling default"):
        EngineOptions.model_validate({"override_generation_config": {"temprature": 0.5}})


def test_max_new_tokens_caps_every_http_request(tmp_path):
    """vLLM's reading of generation_config.json's max_new_tokens: over HTTP the most any request gets, whether it
    asks for more or (completions) for OpenAI's 16; a request that sets none is left for the engine to fill."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 12.0, "temperature": 0.5}))
    defaults = generation_defaults({}, str(tmp_path))
    assert defaults == {"max_tokens": 12, "temperature": 0.5}
    assert generation_defaults({}, "auto", {"max_new_tokens": 7.0}) == {"max_tokens": 7}

    def max_tokens(schema, body):
        return parse_request(schema, {"model": "m", **body}).to_sampling_params(defaults).max_tokens

    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert max_tokens(ChatCompletionRequest, chat) is None
    assert max_tokens(ChatCompletionRequest, {**chat, "max_completion_tokens": 100}) == 12
    assert max_tokens(ChatCompletionRequest, {**chat, "max_tokens": 5}) == 5
    assert max_tokens(CompletionRequest, {"prompt": "Hi"}) == 12
    assert max_tokens(CompletionRequest, {"prompt": "Hi", "max_tokens": 10}) == 10


def test_the_engine_fills_an_unset_max_tokens_up_to_the_cap_or_the_context(tiny_checkpoint):
    """Through the options as the command line and a batch job hand them over (max_new_tokens as given)."""
    overrides = generation_overrides('{"max_new_tokens": 3}')
    options = EngineOptions.model_validate({"override_generation_config": overrides, "max_model_len": 32})
    engine = Engine(str(tiny_checkpoint("llama")), num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=2,
                    warmup=False, **options.engine_kwargs())
    unset = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    assert len(engine.generate([list(range(10, 20))], unset, use_tqdm=False)[0].outputs[0].token_ids) == 3
    assert engine.default_sampling_params().max_tokens is None
    roomy = Engine(str(tiny_checkpoint("llama")), num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=2,
                   warmup=False, max_model_len=32, override_generation_config={"max_new_tokens": 1000})
    # A cap beyond the room left is no error: the request gets the room (vLLM takes the least of the two).
    assert len(roomy.generate([list(range(10, 20))], unset, use_tqdm=False)[0].outputs[0].token_ids) == 22
