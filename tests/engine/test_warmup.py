"""Warm-up compiles what every server needs and defers the rare sampler programs to their first use; the recompile
guard still catches a program no plan foresaw."""

import dataclasses
import logging

import pytest

from jaxserve import Engine, SamplingParams
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.sampler import SamplerFlags

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def test_rare_sampler_programs_compile_once_on_first_use_and_the_guard_counts_only_unforeseen_ones(tiny, caplog):
    engine = Engine(tiny, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=16, recompile_guard="error")
    shape = engine.plan_shape
    warm = ModelRunner.warmup_size(shape, SamplerFlags.warm_variants(penalties=False))
    assert engine.runner.num_compiles == warm < ModelRunner.warmup_size(shape)
    assert len(engine.runner.deferred) == len(shape.buckets.seqs) * 13 + len(shape.buckets.tokens)

    for params in (SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0.7, max_tokens=3),
                   SamplingParams(top_p=0.5, max_tokens=3)):
        engine.generate([PROMPT], params, use_tqdm=False)
    assert engine.runner.num_compiles == warm  # the three warm modes

    with caplog.at_level(logging.INFO, logger="jaxserve"):
        for _ in range(2):
            out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False)
            assert len(out[0].outputs[0].logprobs[0]) >= 2
    stats = engine.stats()
    assert stats["deferred_compiles"] == 1 and stats["compiles_after_warmup"] == 0  # compiled once, not twice
    assert engine.runner.num_compiles == warm + 1
    assert sum("deferred to its first use" in r.getMessage() for r in caplog.records) == 1

    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert engine.stats()["deferred_compiles"] == 2

    # A step shape warm-up never planned (as if the buckets missed one) trips the guard.
    assert 8 not in shape.buckets.tokens
    engine.plan_shape = dataclasses.replace(shape, buckets=Buckets(tuple(sorted({*shape.buckets.tokens, 8})),
                                                                   shape.buckets.seqs))
    with pytest.raises(RuntimeError, match="compiled a new program after warm-up"):
        engine.generate([PROMPT + [9, 10, 11]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)


def test_penalties_the_model_applies_to_every_request_are_warmed(tiny):
    engine = Engine(tiny, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=16, recompile_guard="error",
                    override_generation_config={"repetition_penalty": 1.2})
    engine.generate([PROMPT], SamplingParams(temperature=0.7, repetition_penalty=1.2, max_tokens=3), use_tqdm=False)
    assert engine.stats()["deferred_compiles"] == 0 and engine.compiles_after_warmup == 0
