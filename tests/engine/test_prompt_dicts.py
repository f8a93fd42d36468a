"""vLLM's prompt dicts in Engine.generate: {"prompt": text} or {"prompt_token_ids": ids}, with an optional
"cache_salt" that keeps the prefix cache apart between salts (the same salt shares it, as no salt does); prompts
and parameters in the other forms vLLM's LLM takes."""

import numpy as np
import pytest

from jaxserve import BeamSearchParams, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3)
PROMPT = "Salted prompts share cached blocks only with prompts of the same salt. " * 3  # several full blocks


def run(engine, prompt):
    return engine.generate([prompt], GREEDY, use_tqdm=False)[0]


def test_prompt_dicts_give_the_plain_prompts_outputs(smol_engine):
    plain = run(smol_engine, PROMPT)
    ids = plain.prompt_token_ids
    for prompt in ({"prompt": PROMPT}, {"prompt_token_ids": ids}, {"prompt": PROMPT, "cache_salt": "s"}):
        out = run(smol_engine, prompt)
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, plain.outputs[0].token_ids)
    assert run(smol_engine, {"prompt": PROMPT}).prompt == PROMPT


def test_token_ids_in_a_tuple_or_numpy_and_vllm_s_keyword_names(smol_engine):
    """As vLLM users pass them: token ids as a tuple or a numpy array (a tokenizer's output; numpy's integers
    too), `sampling_params=` by name, a tuple of SamplingParams (one each)."""
    plain = run(smol_engine, PROMPT)
    ids, tokens = plain.prompt_token_ids, plain.outputs[0].token_ids
    prompts = [tuple(ids), np.array(ids), {"prompt_token_ids": np.array(ids, np.int32)}, [np.int64(t) for t in ids]]
    outs = smol_engine.generate(prompts, sampling_params=(GREEDY,) * len(prompts), use_tqdm=False)
    assert [(out.prompt_token_ids, out.outputs[0].token_ids) for out in outs] == [(ids, tokens)] * len(prompts)
    assert all(type(t) is int for out in outs for t in out.prompt_token_ids)
    one = smol_engine.generate(np.array(ids), sampling_params=GREEDY, use_tqdm=False)  # one prompt, as a list's
    assert [out.outputs[0].token_ids for out in one] == [tokens]
    chat = smol_engine.chat([{"role": "user", "content": "Hi"}], sampling_params=GREEDY, use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == GREEDY.max_tokens
    pair = smol_engine.score(np.array(ids[:4]), [tuple(ids[4:8])], use_tqdm=False)[0]  # scores take them alike
    assert pair.outputs.score == smol_engine.score(ids[:4], [ids[4:8]], use_tqdm=False)[0].outputs.score
    # vLLM's LLM methods by their names
    assert smol_engine.get_tokenizer() is smol_engine.tokenizer
    assert smol_engine.get_default_sampling_params() == smol_engine.default_sampling_params()


def test_cache_salt_matches_only_its_own_salt(smol_engine):
    run(smol_engine, PROMPT)
    assert run(smol_engine, PROMPT).num_cached_tokens > 0  # no salt: shared
    assert run(smol_engine, {"prompt": PROMPT, "cache_salt": "tenant-1"}).num_cached_tokens == 0
    assert run(smol_engine, {"prompt": PROMPT, "cache_salt": "tenant-2"}).num_cached_tokens == 0
    assert run(smol_engine, {"prompt": PROMPT, "cache_salt": "tenant-1"}).num_cached_tokens > 0


def test_beam_search_takes_prompt_dicts_but_no_salt(smol_engine):
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    plain = smol_engine.beam_search(["The capital of France is"], params, use_tqdm=False)[0]
    from_dict = smol_engine.beam_search([{"prompt": "The capital of France is"}], params, use_tqdm=False)[0]
    assert [beam.tokens for beam in from_dict.sequences] == [beam.tokens for beam in plain.sequences]
    with pytest.raises(ValueError, match="cache_salt cannot be combined with beam search"):
        smol_engine.beam_search([{"prompt": "x", "cache_salt": "s"}], params, use_tqdm=False)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one of"),
    ({"cache_salt": "x"}, "exactly one of"),
    ({"prompt": "x", "multi_modal_data": {}}, "'multi_modal_data' is not supported"),
    ({"prompt": "x", "cache_salt": ""}, "non-empty string"),
    ({"prompt": "x", "cache_salt": 3}, "non-empty string"),
])
def test_bad_prompt_dicts_are_value_errors(smol_engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        smol_engine.generate([prompt], GREEDY, use_tqdm=False)
