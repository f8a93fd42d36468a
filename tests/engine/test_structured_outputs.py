"""Structured outputs on the real model: the text matches its JSON schema, regex, choice or grammar; requests
without a constraint are unaffected; a bad grammar is refused before anything runs."""

import json
import math
import re

import pytest

from jaxserve import SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams as S

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def chat_text(engine, question, constraint=None, **kw):
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 80), structured_outputs=constraint, **kw)
    out = engine.chat([{"role": "user", "content": question}], params, use_tqdm=False)[0]
    return out.outputs[0]


def test_json_schema(smol_engine):
    out = chat_text(smol_engine, "Describe Ann, who is 30 and has a cat, as JSON.", S(json=PERSON))
    person = json.loads(out.text)
    assert set(person) == {"name", "age", "pets"} and isinstance(person["name"], str)
    assert isinstance(person["age"], int) and set(person["pets"]) <= {"cat", "dog"} and len(person["pets"]) <= 2
    assert out.finish_reason == "stop"


def test_json_object(smol_engine):
    out = chat_text(smol_engine, "What is the capital of France? Answer in JSON.", S(json_object=True))
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop"


@pytest.mark.parametrize("constraint, check", [
    (S(regex=r"\d{3}-\d{4}"), lambda text: re.fullmatch(r"\d{3}-\d{4}", text)),
    (S(choice=["Paris", "Rome", "Berlin"]), lambda text: text in ("Paris", "Rome", "Berlin")),
    (S(grammar='start: "yes" | "no"'), lambda text: text in ("yes", "no")),  # Lark
    (S(grammar='root ::= ("yes" | "no") "!"'), lambda text: text in ("yes!", "no!")),  # GBNF
])
def test_regex_choice_and_grammars(smol_engine, constraint, check):
    out = chat_text(smol_engine, "Is the sky blue? Give a short answer.", constraint)
    assert check(out.text), out.text
    assert out.finish_reason == "stop"  # ended when the grammar was complete, not at max_tokens


def test_the_output_ends_with_its_grammar_even_when_eos_is_ignored(smol_engine):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, structured_outputs=S(choice=["yes", "no"]))
    out = smol_engine.generate("Answer yes or no:", params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert smol_engine.tokenizer.decode(out.token_ids) == out.text  # no EOS tokens after it


def test_logprobs_under_a_grammar_are_over_what_it_allows(smol_engine):
    """As vLLM (logprobs of the logits the grammar masked): a choice's first token is ranked among the choices'
    first tokens alone, and its top logprobs name only those with a probability (they were the model's free top
    tokens); the rest of the five asked for are impossible (-inf, which the server sends as vLLM's -9999)."""
    choices = ["Paris", "Rome", "Berlin"]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=20, structured_outputs=S(choice=choices))
    out = smol_engine.generate("The capital of Italy is", params, use_tqdm=False)[0].outputs[0]
    first = out.logprobs[0]
    possible = [entry.decoded_token for entry in first.values() if entry.logprob > -math.inf]
    # A choice may begin with any token that spells its start ("R" as well as "Rome")
    assert 3 <= len(possible) < 20 and all(any(c.startswith(text) for c in choices) for text in possible), possible
    assert first[out.token_ids[0]].rank == 1
    assert sum(math.exp(entry.logprob) for entry in first.values()) == pytest.approx(1.0, rel=1e-4)


def test_a_grammar_that_starts_after_a_token_leaves_the_text_before_it_free(smol_engine):
    """A reasoning model's grammar starts after its </think> (server/reasoning_parsers.py): here the token is one the
    model writes greedily a few tokens in, so the text up to it matches the free run, and the grammar holds after."""
    prompt = "The three primary colours are"
    free = smol_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # its first occurrence
    constraint = S(choice=["yes", "no"], starts_after_token=free[k])
    out = smol_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint),
                               use_tqdm=False)[0].outputs[0]
    assert out.token_ids[: k + 1] == free[: k + 1]
    assert smol_engine.tokenizer.decode(out.token_ids[k + 1:]) in ("yes", "no") and out.finish_reason == "stop"


def test_every_sample_of_a_request_has_its_own_matcher(smol_engine):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, structured_outputs=S(regex=r"[a-z]{2,6}"))
    outs = smol_engine.generate("A random word:", params, use_tqdm=False)[0].outputs
    assert len(outs) == 3 and all(re.fullmatch(r"[a-z]{2,6}", o.text) for o in outs), [o.text for o in outs]


def test_a_constraint_changes_nothing_for_the_requests_beside_it(smol_engine):
    """A constrained step runs the sampler with every extra and without async overlap; the other rows' tokens
    (greedy and seeded sampling) must stay exactly what they are alone."""
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)]
    prompts = ["The weather today is", "My favourite food is"]
    alone = [o.outputs[0].token_ids for o in smol_engine.generate(prompts, free, use_tqdm=False)]
    mixed = smol_engine.generate(prompts + ["Answer yes or no:"],
                                 free + [SamplingParams(max_tokens=8, structured_outputs=S(choice=["yes", "no"]))],
                                 use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert mixed[2].outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("constraint, words", [
    (S(regex="[a-"), "regex is invalid"),
    (S(json={"type": "strange"}), "json is invalid"),
    (S(grammar="start: undefined_rule"), "grammar is invalid"),
    # what is wrong, not only where llguidance's message began ("regex parse error:")
    (S(regex="(abc"), r"regex parse error: \(abc error: unclosed group"),
    (S(json={"type": "string", "pattern": "a{3,1}"}), r"a\{3,1\} error: invalid repetition count range"),
])
def test_an_invalid_grammar_is_refused_before_anything_runs(smol_engine, constraint, words):
    # The shared engine may still hold the step an earlier test's generate launched ahead (async scheduling reads
    # it back on the next step): start from an idle engine, so what is left afterwards is this call's.
    while smol_engine.has_unfinished_requests():
        smol_engine.step()
    steps = smol_engine.stats()["num_steps"]
    ok = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=words):
        smol_engine.generate(["fine", "bad"], [ok, SamplingParams(max_tokens=2, structured_outputs=constraint)],
                             use_tqdm=False)
    assert smol_engine.stats()["num_steps"] == steps and not smol_engine.has_unfinished_requests()


def test_a_grammar_is_compiled_once_and_copied_for_each_sequence(smol_engine, monkeypatch):
    compiled = []
    compile_ = smol_engine.grammars._compile
    monkeypatch.setattr(smol_engine.grammars, "_compile", lambda p, g: compiled.append(g) or compile_(p, g))
    params = SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=8, structured_outputs=S(regex="[xyz]{4}"))
    for _ in range(2):  # two requests with the same grammar, two sequences each
        outs = smol_engine.generate("Letters:", params, use_tqdm=False)[0].outputs
        assert all(re.fullmatch("[xyz]{4}", o.text) for o in outs), [o.text for o in outs]
    assert len(compiled) == 1
