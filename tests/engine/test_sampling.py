"""Sampling controls change outputs the way their definitions say, checked on the real model."""

import torch

from jaxserve import SamplingParams

PROMPT = "The best thing about the city is the the the"


def greedy_ids(engine, prompt=PROMPT, **kw):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)
    return engine.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_filters_that_leave_one_candidate_give_the_greedy_tokens(smol_engine):
    greedy = greedy_ids(smol_engine)
    # top_p=1e-300 is 0 in float32: the nucleus must still keep the top token.
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(top_p=1e-300), dict(min_p=1.0)):
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3, **kw)
        assert smol_engine.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == greedy, kw


def test_repetition_penalty_matches_transformers(smol_engine, hf_smollm2):
    ids = smol_engine.tokenizer(PROMPT)["input_ids"]
    ours = greedy_ids(smol_engine, ids, repetition_penalty=1.5)
    t = torch.tensor([ids])
    with torch.no_grad():
        ref = hf_smollm2.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False, repetition_penalty=1.5)
    assert ours == ref[0, len(ids):].tolist()
    assert ours != greedy_ids(smol_engine, ids)


def test_frequency_and_presence_penalties_reduce_repeats(smol_engine):
    plain = greedy_ids(smol_engine)
    for kw in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0)):
        penalised = greedy_ids(smol_engine, **kw)
        assert len(set(penalised)) > len(set(plain)), kw


def test_logit_bias_forces_a_token(smol_engine):
    token = smol_engine.tokenizer(" banana")["input_ids"][0]
    assert set(greedy_ids(smol_engine, logit_bias={token: 100.0})) == {token}
    assert token not in greedy_ids(smol_engine, prompt="I like to eat a banana and a banana and a",
                                   logit_bias={str(token): -100.0})


def test_min_tokens_holds_off_eos(smol_engine):
    eos = smol_engine.tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100.0})
    out = smol_engine.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    # with ignore_eos too, as vLLM: EOS is banned until min_tokens, then sampled (and stops nothing)
    ignoring = smol_engine.generate(PROMPT, params.replace(ignore_eos=True, max_tokens=7), use_tqdm=False)[0]
    assert eos not in ignoring.outputs[0].token_ids[:5] and ignoring.outputs[0].token_ids[5:] == [eos, eos]


def test_stop_token_ids_and_special_tokens(smol_engine):
    plain = greedy_ids(smol_engine)
    out = smol_engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[plain[3]]),
                               use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain[:4] and out.finish_reason == "stop" and out.stop_reason == plain[3]
    im_start = smol_engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    kept = SamplingParams(temperature=0, max_tokens=3, logit_bias={im_start: 100.0}, skip_special_tokens=False)
    assert "<|im_start|>" in smol_engine.generate(PROMPT, kept, use_tqdm=False)[0].outputs[0].text
    assert "<|im_start|>" not in smol_engine.generate(PROMPT, kept.replace(skip_special_tokens=True),
                                                      use_tqdm=False)[0].outputs[0].text


def greedy_output(engine, **kw):
    kw = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw}
    return engine.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_stop_strings_wait_for_min_tokens(smol_engine):
    """vLLM checks stop strings only after min_tokens tokens: a stop string the first ones complete is text."""
    free = greedy_output(smol_engine)
    first_token_text = smol_engine.tokenizer.decode(free.token_ids[:1])
    stop = first_token_text.strip()[:1]  # completed by the first token
    assert stop
    assert greedy_output(smol_engine, stop=[stop]).token_ids == free.token_ids[:1]
    held = greedy_output(smol_engine, stop=[stop], min_tokens=3)
    assert len(held.token_ids) > 3 and held.text.startswith(first_token_text)


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(smol_engine):
    free = greedy_output(smol_engine)
    last = smol_engine.tokenizer.decode(free.token_ids[:4])
    stop = last[len(smol_engine.tokenizer.decode(free.token_ids[:3])):].strip()  # the 4th token's own text
    assert stop and stop not in smol_engine.tokenizer.decode(free.token_ids[:3])
    out = greedy_output(smol_engine, stop=[stop], max_tokens=4)
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", stop, free.token_ids[:4])
    assert not out.text.endswith(stop)


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(smol_engine):
    free = greedy_output(smol_engine)
    stop_token = free.token_ids[3]
    kept = greedy_output(smol_engine, stop_token_ids=[stop_token], include_stop_str_in_output=True)
    dropped = greedy_output(smol_engine, stop_token_ids=[stop_token])
    assert kept.token_ids == dropped.token_ids == free.token_ids[:4]
    assert kept.text == smol_engine.tokenizer.decode(free.token_ids[:4])
    assert dropped.text == smol_engine.tokenizer.decode(free.token_ids[:3])
    # The stop token ended it: its text, kept, is no stop string's stop (as vLLM)
    token_text = smol_engine.tokenizer.decode([stop_token])
    both = greedy_output(smol_engine, stop_token_ids=[stop_token], stop=[token_text], include_stop_str_in_output=True)
    assert (both.stop_reason, both.text) == (stop_token, kept.text)


def test_a_stream_left_early_is_aborted(smol_engine):
    free_before = smol_engine.stats()["free_blocks"]
    stream = smol_engine.stream(PROMPT, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    next(stream)
    stream.close()
    stats = smol_engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    leftovers = []
    while smol_engine.has_unfinished_requests():  # the step in flight when it was aborted is read back
        leftovers += smol_engine.step()
    assert leftovers == [] and smol_engine.stats()["free_blocks"] == free_before  # every block back
