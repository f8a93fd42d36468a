"""Engine options are declared once (jaxserve.engine_args.EngineArgs): the command line's engine flags, a batch
job's `engine:` keys and Engine's keywords all come from its fields, with one set of checks."""

import argparse
import dataclasses
import inspect
import logging

import pytest

from jaxserve.batch.job_config import EngineOptions
from jaxserve.cli.engine_options import add_engine_arguments, engine_args_from
from jaxserve.config import MeshShape
from jaxserve.engine_args import EngineArgs, option_fields
from jaxserve.errors import UserError


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser


def test_the_three_surfaces_list_the_same_options():
    from jaxserve.engine import Engine

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(inspect.signature(Engine).parameters) == fields  # Engine(model, **options): every field, no more
    job_keys = set(EngineOptions.model_fields) - {"data_parallel_size"}  # how many Engines, not an Engine option
    assert job_keys == {f.name for f in option_fields("job")} - {"model"}  # the model is the job's own key
    flags = {s for action in engine_parser()._actions for s in action.option_strings}
    for f in option_fields("cli"):
        assert set(f.metadata["flags"] or [f"--{f.name.replace('_', '-')}"]) <= flags, f.name
    assert {f.name for f in dataclasses.fields(EngineArgs) if not f.metadata["cli"]} == {"model", "devices"}


def test_flag_defaults_are_the_engine_defaults_and_flags_reach_their_fields():
    assert engine_args_from(engine_parser().parse_args([])) == EngineArgs()
    args = engine_parser().parse_args(["m", "-tp", "2", "--no-warmup", "--gpu-memory-utilization", "0.5",
                                       "--lora-modules", "a=/x", "--async-scheduling", "--max-model-len", "32k",
                                       "--recompile-guard", "error"])
    options = engine_args_from(args)
    assert options.changed() == dict(model="m", tensor_parallel_size=2, warmup=False, kv_cache_memory_fraction=0.5,
                                     lora_modules={"a": "/x"}, max_model_len=32000, recompile_guard="error")
    assert options.engine_kwargs()["mesh"] == MeshShape(2, 1) and "tensor_parallel_size" not in options.engine_kwargs()
    assert engine_args_from(engine_parser().parse_args(["--no-async-scheduling"])).async_scheduling is False


@pytest.mark.parametrize("options, message", [
    (dict(block_size=0), "block_size must be a positive integer, got 0"),
    (dict(kv_cache_memory_fraction=1.5), r"kv_cache_memory_fraction must be in \(0, 1\], got 1.5"),
    (dict(quantization="int4"), "quantization must be one of int8, w8a8, fp8, gguf, compressed-tensors, gptq, awq, mxfp4, none, got 'int4'"),
    (dict(dtype="float16"), "dtype 'float16' is not supported: use bfloat16"),
    (dict(mesh="2x1", tensor_parallel_size=2), "not both"),
    (dict(lora_modules={"a": 1}), "lora_modules must map adapter names"),
    (dict(speculative_config={"method": "eagle"}), "method 'eagle'"),
])
def test_one_set_of_checks_one_sentence_each(options, message):
    with pytest.raises(ValueError, match=message) as info:
        EngineArgs(**options)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=message):  # the same rule, reached from the command line
        engine_args_from(engine_parser().parse_args([]), **options)


def test_vllm_names_are_aliases_and_an_unknown_keyword_is_named():
    assert EngineArgs.of(gpu_memory_utilization=0.5, num_gpu_blocks_override=8).changed() == \
        dict(kv_cache_memory_fraction=0.5, num_kv_blocks=8)
    with pytest.raises(TypeError, match="Engine has no option 'max_num_seq'; its options are mesh, "):
        EngineArgs.of(max_num_seq=8)
    for off in ("", "none"):  # turn the cache off
        assert EngineArgs(compilation_cache_dir=off).compilation_cache_dir is None


def test_vllm_options_that_mean_nothing_here_are_accepted_with_a_warning(caplog):
    """`LLM(model, trust_remote_code=True, enforce_eager=True)` opens most vLLM scripts: the options are taken, each
    with a warning saying why it changes nothing; left unset (False), nothing is said; an unserved task is refused."""
    with caplog.at_level(logging.WARNING, "jaxserve.engine"):
        args = EngineArgs.of(trust_remote_code=True, enforce_eager=True, swap_space=4, task="generate",
                             compilation_config={"level": 3}, max_model_len=64)
    assert args.changed() == {"max_model_len": 64}
    assert "Engine(trust_remote_code=True) has no effect in jaxserve: jaxserve runs no code" in caplog.text
    assert "Engine(enforce_eager=True) has no effect in jaxserve: JAX compiles" in caplog.text
    assert "Engine(compilation_config={'level': 3}) has no effect" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "jaxserve.engine"):
        EngineArgs.of(trust_remote_code=False, enforce_eager=False)
    assert caplog.text == ""
    with pytest.raises(ValueError, match="task reward is not supported: reward models' per-token scores"):
        EngineArgs.of(task="reward")
    with pytest.raises(ValueError, match="runner='pool' is not one of vLLM's: auto, generate, pooling"):
        EngineArgs.of(runner="pool")
    # vLLM's defaults, as scripts pass them: the fast tokenizer, no offload, prefix caching left to the engine
    caplog.clear()
    with caplog.at_level(logging.WARNING, "jaxserve.engine"):
        args = EngineArgs.of(tokenizer_mode="auto", cpu_offload_gb=0, enable_prefix_caching=None,
                             max_model_len="32k", structured_outputs_config={"backend": "auto"})
    assert args.changed() == {"max_model_len": 32_000} and args.enable_prefix_caching
    assert caplog.text.count("has no effect") == 1  # structured_outputs_config's backend
    for refused, message in ((dict(tokenizer_mode="mistral"), "tokenizer_mode mistral is not supported"),
                             (dict(cpu_offload_gb=8), "cpu_offload_gb=8 is not supported")):
        with pytest.raises(ValueError, match=message):
            EngineArgs.of(**refused)


def test_the_python_docs_table_lists_every_option():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "python.md").read_text()
    missing = [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model" and f"| `{f.name}`" not in page]
    assert not missing, f"docs/python.md's options table lacks {missing}"
