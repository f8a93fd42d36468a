"""Speculative decoding (n-gram drafts) end to end: the tokens are those one-at-a-time decoding gives, greedy
and seeded, on the real model and on a 2x2 mesh, with logits matching transformers at every position kept."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine, SamplingParams
from tests.helpers import hf_greedy_choices
from tests.models.test_parity import PROMPTS, check_parity

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
PARAGRAPH = ("The river flows through the old town, past the market square and the stone bridge, where fishermen "
             "sell their catch every morning.")


@pytest.fixture(scope="module")
def spec_engine(smollm2_gguf_path):
    # The shared smol_engine's settings, so the two differ only in speculation.
    return Engine(smollm2_gguf_path, max_model_len=1024, num_kv_blocks=512, max_num_seqs=16,
                  max_num_batched_tokens=256, warmup=False, speculative_config=NGRAM)


def copy_prompt(engine) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": "Copy this exactly, word for word:\n\n" + PARAGRAPH}])


def token_ids(engine, prompts, params):
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def test_greedy_tokens_equal_decoding_one_at_a_time_and_transformers(spec_engine, smol_engine, hf_smollm2):
    prompts = [copy_prompt(spec_engine), "The best thing about the city is the the the"]
    params = SamplingParams(temperature=0, max_tokens=40)  # the copy ends with EOS, as transformers' does
    before = spec_engine.stats()
    ours = token_ids(spec_engine, prompts, params)
    after = spec_engine.stats()
    assert ours == token_ids(smol_engine, prompts, params)
    assert ours[0] == hf_greedy_choices(hf_smollm2, prompts[0], ours[0])
    assert ours[0][-1] == spec_engine.tokenizer.eos_token_id
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted  # drafts were both kept and turned down


def test_seeded_sampling_logprobs_and_stops_are_unchanged(spec_engine, smol_engine):
    prompts = [copy_prompt(spec_engine), "Once upon a time"]
    # The copy ends with EOS after `last` tokens: with min_tokens=last it may end there, not a token earlier. Each
    # of a drafted step's rows must apply the ban by the position it samples, or a row past it bans EOS too.
    last = len(token_ids(smol_engine, prompts[:1], SamplingParams(temperature=0, max_tokens=60))[0]) - 1
    cases = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=32, seed=7, n=2, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=40, logprobs=2, stop=[" bridge"]),
             SamplingParams(temperature=0, max_tokens=60, min_tokens=last),
             # penalties mild enough that the copy (and its drafts) goes on; the rows' histories: test_plan_drafts.py
             SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.05, frequency_penalty=0.1)]
    # Every case in one batch on each engine: drafted and plain rows of different sampling settings side by side
    requests = [(prompt, params) for params in cases for prompt in prompts]
    accepted = spec_engine.stats()["spec_decode_num_accepted_tokens"]
    ours, theirs = (engine.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
                    for engine in (spec_engine, smol_engine))
    for (prompt, params), a, b in zip(requests, ours, theirs):
        assert [(o.token_ids, o.text, o.finish_reason) for o in a.outputs] == \
               [(o.token_ids, o.text, o.finish_reason) for o in b.outputs]
        if params.logprobs:
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        if prompt is prompts[0] and params.stop:
            assert b.outputs[0].finish_reason == "stop"  # the copy reached the stop string
        if prompt is prompts[0] and params.min_tokens:
            assert len(b.outputs[0].token_ids) == last + 1
    assert spec_engine.stats()["spec_decode_num_accepted_tokens"] > accepted  # drafts were kept in this batch


def test_logits_match_transformers_on_a_2x2_mesh(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine(str(path), mesh="2x2", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                    warmup=False, speculative_config=dict(NGRAM, prompt_lookup_min=1))
    check_parity(engine, reference, PROMPTS, max_tokens=16)
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_an_engine_of_one_sequence_drafts_all_k_tokens(tiny_checkpoint):
    """Sampler rows are sized for every sequence's drafts: max_num_seqs=1 drafted nothing (its one row was the
    sequence's own), max_num_seqs=2 one token a step."""
    path = tiny_checkpoint("llama")
    prompt = [5, 6, 7, 8] * 6
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = Engine(str(path), num_kv_blocks=16, max_num_seqs=1, warmup=False)
    engine = Engine(str(path), num_kv_blocks=16, max_num_seqs=1, warmup=False,
                    speculative_config=dict(NGRAM, prompt_lookup_min=1))
    assert token_ids(engine, [prompt], greedy) == token_ids(plain, [prompt], greedy)
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_drafts"]  # more than one token a draft


def test_bad_settings_are_refused_before_loading():
    with pytest.raises(ValueError, match="method 'medusa'"):
        Engine("/nonexistent", speculative_config={"method": "medusa", "num_speculative_tokens": 2})


def test_served_stream_matches_and_metrics_count_the_drafts(spec_engine, smol_engine):
    import json

    import httpx

    from jaxserve.async_engine.engine import AsyncEngine
    from jaxserve.server.app import build_app
    from tests.server.helpers import metric_value, serve_in_thread

    messages = [{"role": "user", "content": "Copy this exactly, word for word:\n\n" + PARAGRAPH}]
    expected = smol_engine.chat(messages, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    app = build_app(AsyncEngine(spec_engine), served_model_names=["smol"])  # stops its loop thread at exit
    with serve_in_thread(app) as url:
        body = {"model": "smol", "messages": messages, "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == expected.outputs[0].text
        assert metric_value(url, "jaxserve:spec_decode_num_accepted_tokens_total") > 0
        assert metric_value(url, "jaxserve:spec_decode_num_draft_tokens_total") >= \
            metric_value(url, "jaxserve:spec_decode_num_accepted_tokens_total")
        positions = range(len(spec_engine.stats()["spec_decode_num_accepted_tokens_per_pos"]))
        per_position = [metric_value(url, "jaxserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                        for i in positions]
        assert len(per_position) > 1 and sum(per_position) == metric_value(
            url, "jaxserve:spec_decode_num_accepted_tokens_total")
        assert per_position == sorted(per_position, reverse=True) and per_position[0] > 0  # a later one needs earlier


def test_a_constrained_request_beside_a_drafting_one(spec_engine, smol_engine):
    """Sampler rows are not chunk indices once a chunk drafts: the grammar's row must still find its chunk."""
    from jaxserve.sampling_params import StructuredOutputsParams

    prompts = [copy_prompt(spec_engine), "Answer yes or no: is the sky blue?"]
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    ours = [o.outputs[0].text for o in spec_engine.generate(prompts, params, use_tqdm=False)]
    assert ours == [o.outputs[0].text for o in smol_engine.generate(prompts, params, use_tqdm=False)]
    assert ours[1] in ("yes", "no")


def test_constrained_requests_draft_and_keep_their_tokens(spec_engine, smol_engine):
    """Under a grammar each drafted row is masked by the grammar after the drafts before it, so constrained output
    equals one-at-a-time decoding, and drafts the grammar accepts are kept."""
    import re

    from jaxserve.sampling_params import StructuredOutputsParams

    words = r"[A-Za-z ,.]+"
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=words))
    prompts = [copy_prompt(spec_engine)]
    before = spec_engine.stats()
    ours = [o.outputs[0].text for o in spec_engine.generate(prompts, params, use_tqdm=False)]
    accepted = spec_engine.stats()["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert ours == [o.outputs[0].text for o in smol_engine.generate(prompts, params, use_tqdm=False)]
    assert re.fullmatch(words, ours[0]) and accepted > 0
