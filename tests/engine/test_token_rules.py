"""vLLM's allowed_token_ids and bad_words on SmolLM2, against transformers' generate with the same rules
(`suppress_tokens`, `bad_words_ids`). The shared engine schedules asynchronously, so a bad word whose
next-to-last token is still on the device is banned by the sampler's check of that token."""

import pytest
import torch

from jaxserve import SamplingParams
from jaxserve.core.token_rules import bad_words_token_ids

PROMPT = "The capital of France is"


def greedy(engine, max_tokens=16, **rules):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **rules)
    return engine.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def transformers_greedy(model, engine, max_tokens=16, **rules):
    ids = torch.tensor([engine.tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             **rules)
    return out[0, ids.shape[1]:].tolist()


def contains(tokens, word):
    return any(tokens[i : i + len(word)] == list(word) for i in range(len(tokens)))


def test_bad_words_match_transformers(smol_engine, hf_smollm2):
    plain = greedy(smol_engine)
    # "Paris" comes first; without it the model writes " the capital of the French Republic", whose two- and
    # three-token words are banned after their first tokens.
    words = ["Paris", "capital of", "French Republic"]
    bad = bad_words_token_ids(smol_engine.tokenizer, words, smol_engine.config.model.vocab_size)
    assert {len(w) for w in bad} == {1, 2}, bad  # the spellings include multi-token ones
    prompt_ids = smol_engine.tokenizer(PROMPT)["input_ids"]
    # transformers also matches a word across the prompt's end, which vLLM does not: none does here.
    assert not any(len(w) > 1 and prompt_ids[-1] == w[0] for w in bad)
    got = greedy(smol_engine, bad_words=words)
    assert got != plain and not any(contains(got, w) for w in bad)
    assert got == transformers_greedy(hf_smollm2, smol_engine, bad_words_ids=[list(w) for w in bad])
    one_word = greedy(smol_engine, bad_words=words[:1])
    assert any(contains(one_word, w) for w in bad if len(w) > 1), "the multi-token words changed nothing"


def test_allowed_token_ids_match_transformers(smol_engine, hf_smollm2):
    allowed = smol_engine.tokenizer(" the city of lights and love, Paris.")["input_ids"]
    got = greedy(smol_engine, allowed_token_ids=allowed)
    assert set(got) <= set(allowed) and len(set(got)) > 1
    vocab = smol_engine.config.model.vocab_size
    others = sorted(set(range(vocab)) - set(allowed))
    assert got == transformers_greedy(hf_smollm2, smol_engine, suppress_tokens=others)


def test_rules_combine_with_each_other_and_a_grammar(smol_engine):
    allowed = smol_engine.tokenizer(" yes no maybe")["input_ids"]
    got = greedy(smol_engine, max_tokens=4, allowed_token_ids=allowed, bad_words=["yes"])
    assert got and set(got) <= set(allowed) - set(smol_engine.tokenizer(" yes")["input_ids"])
    # The grammar alone answers "no"; the allowed tokens leave one spelling of each word, which bad_words takes.
    grammar = {"choice": ["yes", "no"]}
    assert smol_engine.generate(PROMPT, SamplingParams(temperature=0, structured_outputs=grammar),
                                use_tqdm=False)[0].outputs[0].text == "no"
    tokens = [smol_engine.tokenizer(word)["input_ids"][0] for word in ("yes", "no")] + list(smol_engine.eos_token_ids())
    choice = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=tokens, bad_words=["no"],
                            structured_outputs=grammar)
    assert smol_engine.generate(PROMPT, choice, use_tqdm=False)[0].outputs[0].text == "yes"


@pytest.mark.parametrize("rules, message", [
    (dict(allowed_token_ids=[10**6]), "allowed_token_ids has token id 1000000, outside the vocabulary"),
    (dict(bad_words=[f"word{i}" for i in range(200)]), "at most 320 fit"),
])
def test_rules_the_model_cannot_hold_are_refused(smol_engine, rules, message):
    with pytest.raises(ValueError, match=message):
        smol_engine.generate(PROMPT, SamplingParams(max_tokens=2, **rules), use_tqdm=False)
