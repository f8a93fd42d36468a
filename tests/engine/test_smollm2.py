"""The real SmolLM2-135M-Instruct (GGUF) against transformers, and the engine's batching guarantees."""

import pytest

from jaxserve import SamplingParams
from jaxserve.engine.steps import StepLog
from tests.helpers import hf_greedy_choices

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "日本の首都は",
    "Translate to French: I like apples.",
    "The quick brown fox",
]
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32)


def test_greedy_matches_transformers_generate(smol_engine, hf_smollm2):
    outs = smol_engine.generate(PROMPTS, GREEDY_32, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ours = out.outputs[0].token_ids  # ends with EOS (kept as the last token id) or after 32 tokens
        assert len(ours) == 32 or ours[-1] == smol_engine.tokenizer.eos_token_id, prompt
        assert ours == hf_greedy_choices(hf_smollm2, out.prompt_token_ids, ours), prompt


def test_chat_prompt_ids_match_apply_chat_template(smol_engine, smol_tokenizer):
    reference = smol_tokenizer  # transformers' own reading of the GGUF's tokenizer and chat template
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a fruit."}],
    ]
    for conv in conversations:
        expected = reference.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert smol_engine.encode_chat(conv) == list(expected)
    out = smol_engine.chat(conversations[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt_token_ids == smol_engine.encode_chat(conversations[0])
    assert out.outputs[0].text


def test_greedy_tokens_same_alone_and_in_a_batch_of_16(smol_engine):
    target = "Write a haiku about the sea."
    alone = smol_engine.generate(target, GREEDY_32, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"Story {i}: " + "and then " * (i * 3) for i in range(15)]  # mixed lengths
    batch = smol_engine.generate(others[:7] + [target] + others[7:], GREEDY_32, use_tqdm=False)
    assert batch[7].outputs[0].token_ids == alone


def test_seeded_sampling_same_alone_and_in_a_batch(smol_engine):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24)
    alone = smol_engine.generate("Tell me a joke.", seeded, use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=1.0, max_tokens=24)] * 5 + [seeded]
    prompts = [f"Random prompt number {i}" for i in range(5)] + ["Tell me a joke."]
    batch = smol_engine.generate(prompts, params, use_tqdm=False)
    assert batch[5].outputs[0].token_ids == alone
    other_seed = smol_engine.generate("Tell me a joke.", seeded.replace(seed=99), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone  # the seed matters


def test_requests_join_a_running_batch(smol_engine):
    """Continuous batching: a request added while another decodes starts before the first one finishes."""
    e = smol_engine
    steps = StepLog()
    e.observers.append(steps)
    e.add_request("first", "Count: one, two, three,", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        e.step()
    e.add_request("second", "Another prompt", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    done = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
    steps_of = lambda rid: [r.index for r in steps.records if any(c[0] == rid for c in r.chunks)]  # noqa: E731
    assert min(steps_of("second")) < max(steps_of("first"))
    # ...and it ran in the same steps as the first one, not after it
    shared = [r for r in steps.records if {c[0] for c in r.chunks} == {"first", "second"}]
    assert shared
    assert done["second"].finished and len(done["first"].outputs[0].token_ids) == 20
    assert e.stats()["free_blocks"] == e.stats()["total_blocks"]
    e.observers.remove(steps)


def test_stream_pieces_concatenate_to_final_text(smol_engine):
    params = SamplingParams(temperature=0, max_tokens=24)
    last, previous_text = None, ""
    for out in smol_engine.stream("日本の首都は", params):
        text = out.outputs[0].text
        assert text.startswith(previous_text)  # streamed text only grows
        previous_text, last = text, out
    final = smol_engine.generate("日本の首都は", params, use_tqdm=False)[0].outputs[0]
    assert last.finished and previous_text == final.text
    assert "\ufffd" not in final.text


def test_n_best_of_stop_and_logprobs(smol_engine):
    out = smol_engine.generate("The quick brown fox", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                                     logprobs=0), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    best = smol_engine.generate("The quick brown fox", SamplingParams(n=1, best_of=3, temperature=1.0, seed=7,
                                                                      max_tokens=8), use_tqdm=False)[0]
    assert len(best.outputs) == 1
    assert best.outputs[0].cumulative_logprob == max(o.cumulative_logprob for o in out.outputs)

    greedy = smol_engine.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=20),
                                  use_tqdm=False)[0].outputs[0]
    stop = greedy.text.split()[2]
    stopped = smol_engine.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                                   use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == greedy.text[: greedy.text.index(stop)]

    lp = smol_engine.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                                  prompt_logprobs=2), use_tqdm=False)[0]
    first = lp.outputs[0].logprobs[0]
    token = lp.outputs[0].token_ids[0]
    assert first[token].rank == 1 and len(first) == 3  # greedy: the chosen token is the top one
    assert lp.prompt_logprobs[0] is None and len(lp.prompt_logprobs) == len(lp.prompt_token_ids)
    assert all(lp.prompt_token_ids[i] in lp.prompt_logprobs[i] for i in range(1, len(lp.prompt_token_ids)))
    assert abs(sum(l.logprob for p in lp.outputs[0].logprobs for t, l in p.items() if l.rank == 1)
               - lp.outputs[0].cumulative_logprob) < 1e-3

    # logprobs=0: the chosen token's logprob alone; no logprobs asked: none computed, none reported.
    chosen = smol_engine.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=4, logprobs=0),
                                  use_tqdm=False)[0].outputs[0]
    assert [list(p) for p in chosen.logprobs] == [[t] for t in lp.outputs[0].token_ids]
    assert [p[t].logprob for p, t in zip(chosen.logprobs, chosen.token_ids)] == pytest.approx(
        [p[t].logprob for p, t in zip(lp.outputs[0].logprobs, chosen.token_ids)], abs=1e-5)
    plain = smol_engine.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert plain[0].outputs[0].logprobs is None and plain[0].outputs[0].cumulative_logprob is None


def test_steps_can_return_only_the_requests_they_finish(smol_engine):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 5)]
    for i, p in enumerate(params):
        smol_engine.add_request(f"only-finished-{i}", PROMPTS[i], p)
    seen = []
    while smol_engine.has_unfinished_requests():
        seen += smol_engine.step(finished_only=True)
    assert [o.request_id for o in seen] == ["only-finished-0", "only-finished-1"]
    assert all(o.finished for o in seen)
    expected = smol_engine.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in seen] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in seen] == [o.outputs[0].text for o in expected]
