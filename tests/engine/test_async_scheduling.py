"""Async scheduling: step N+1 is scheduled and dispatched before step N is read back, its decode inputs taken
from step N's sampled tokens on the device. Whatever a request asks for, the outputs must be exactly those of
the synchronous engine (`async_scheduling=False`), which reads every step back before scheduling the next.

Each test runs on one device and on a 3-stage pipeline, where the async engine keeps its stages busy across steps
(a new step enters stage 0 every tick while earlier ones move on, engine._tick) and the synchronous one runs each
step's micro-batches through the stages within the step: the same tokens, whatever the interleaving (and the same
logprobs but for their last bit: the two batch the rows differently)."""

import re

import pytest

from jaxserve import Engine, SamplingParams
from jaxserve.core.request import PLACEHOLDER
from jaxserve.engine.steps import StepLog
from jaxserve.runner import plan
from tests.helpers import assert_equal_up_to_rounding

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time,"]


@pytest.fixture(scope="module", params=["1x1", "1x3"])
def engines(request, tiny_checkpoint):
    """(async engine, sync engine) on one tiny Llama (3 layers) and a mesh; a small cache so that long runs
    preempt."""
    path = str(tiny_checkpoint("llama", tie_word_embeddings=False))
    kw = dict(max_model_len=128, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=32, warmup=False,
              mesh=request.param)
    fast = Engine(path, **kw)
    assert fast.stage_ticks == (request.param == "1x3")
    return fast, Engine(path, async_scheduling=False, **kw)


def run(engine, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in out.outputs] for out in engine.generate(prompts, params, use_tqdm=False)]


def both(engines, prompts, params):
    fast, slow = engines
    got, expected = run(fast, prompts, params), run(slow, prompts, params)
    # One device: the same programs on the same rows, bit for bit. 1x3: the ticks batch the rows unlike the
    # fill-drain steps, so logprobs may differ in their last bit.
    assert_equal_up_to_rounding(got, expected, tol=1e-5 if fast.stage_ticks else 0.0)
    return got


def test_greedy_sampled_and_n_best_of_match_the_synchronous_engine(engines):
    greedy = both(engines, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert all(len(c[0][0]) == 12 for c in greedy)
    both(engines, PROMPTS, SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True))
    both(engines, PROMPTS[:2], SamplingParams(n=2, best_of=3, temperature=1.0, seed=5, max_tokens=6,
                                              ignore_eos=True))
    both(engines, PROMPTS, SamplingParams(temperature=0, max_tokens=6, logprobs=2, min_tokens=3))


def test_constrained_requests_beside_free_ones_match_the_synchronous_engine(engines):
    """A constrained sequence's next mask needs the token in flight: the engine reads every step back before it
    plans one where such a sequence samples (on 1x3: before the next tick), the free requests beside it as usual."""
    from jaxserve.sampling_params import StructuredOutputsParams

    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    digits = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{2}"))
    fast, slow = engines
    prompts, params = PROMPTS, [digits, free, digits, free]
    got = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
           for o in fast.generate(prompts, params, use_tqdm=False)]
    assert got == [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
                   for o in slow.generate(prompts, params, use_tqdm=False)]
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{2}", got[i][0][1]) and got[i][0][2] == "stop" for i in (0, 2)), got


def test_lengths_of_one_to_three_tokens_and_the_context_limit(engines):
    for n in (1, 2, 3):
        out = both(engines, PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert all(len(c[0][0]) == n and c[0][2] == "length" for c in out)
    # A prompt 2 tokens short of max_model_len: the step that would pass the context is never scheduled.
    fast, _ = engines
    long_prompt = list(range(100, 226))
    out = both(engines, [long_prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out[0][0][0]) == 2 and out[0][0][2] == "length"
    # max_tokens beyond the room it leaves is cut to it, as vLLM cuts it, the prompt beside it served in full (one
    # request of an offline batch asking too much refused the whole batch); more than any context holds is refused
    out = both(engines, [long_prompt, PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [(len(c[0][0]), c[0][2]) for c in out] == [(2, "length"), (10, "length")]
    with pytest.raises(ValueError, match="max_tokens=129 is more than the model's maximum context length of 128"):
        fast.generate(PROMPTS[:1], SamplingParams(max_tokens=129), use_tqdm=False)
    assert fast.blocks.num_free_blocks == fast.config.cache.num_blocks - 1  # every block back, null block aside


@pytest.mark.parametrize("max_tokens", [None, 120])
def test_n_sequences_up_to_the_context_share_a_cache_too_small_for_all_of_them(engines, max_tokens):
    """Each of 4 sequences may grow to max_model_len (4 x 128 tokens: max_tokens left out, or asked for), more than
    the whole cache (23 blocks x 16): admitted as vLLM admits them, they take turns, preempted and recomputed, and
    all finish."""
    fast, _ = engines
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=True)
    prompt_len = len(fast.tokenizer(PROMPTS[0])["input_ids"])
    assert 4 * (prompt_len + (max_tokens or 128 - prompt_len)) > 23 * 16
    out = both(engines, PROMPTS[:1], params)
    assert [len(choice[0]) for choice in out[0]] == [max_tokens or 128 - prompt_len] * 4
    assert fast.blocks.num_free_blocks == fast.config.cache.num_blocks - 1
    with pytest.raises(ValueError, match=r"400 sequences need \d+ tokens of KV cache to start .* lower n, or"):
        fast.generate(PROMPTS[:1], params.replace(n=400), use_tqdm=False)  # even their starts do not fit


def test_stop_strings_and_tokens_found_while_the_next_step_runs(engines):
    _, slow = engines
    free = slow.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    stop = free[0].outputs[0].text[4:7]  # a string the first prompt's greedy text contains
    stop_token = free[1].outputs[0].token_ids[5]
    out = both(engines, PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                stop_token_ids=[stop_token]))
    assert out[0][0][2] == "stop" and stop not in out[0][0][1]
    assert out[1][0][2] == "stop" and len(out[1][0][0]) <= 6
    # generate returns once every request finished; a step launched before the stop was seen may still be unread
    # (has_unfinished_requests says so). Draining it gives no outputs, and every block is already free.
    fast, _ = engines
    drained = []
    while fast.has_unfinished_requests():
        drained += fast.step()
    assert drained == [] and fast.blocks.num_free_blocks == fast.config.cache.num_blocks - 1


@pytest.mark.parametrize("penalties", [{}, dict(repetition_penalty=1.3, frequency_penalty=0.4)])
def test_preemption_while_a_step_is_in_flight(engines, penalties):
    fast, _ = engines
    before = fast.scheduler.num_preemptions
    both(engines, PROMPTS * 2, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **penalties))
    assert fast.scheduler.num_preemptions > before  # 8 sequences of ~50 tokens do not fit 23 blocks of 16


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_penalties_count_the_token_still_on_the_device(engines, monkeypatch, temperature):
    """The history a step's penalties read holds the previous step's token, which only the device knows yet:
    the steps still overlap, and every penalty sees what the synchronous engine's does."""
    sources = spy_token_sources(monkeypatch)
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=16, repetition_penalty=1.5,
                            presence_penalty=0.7, frequency_penalty=0.6, ignore_eos=True)
    both(engines, PROMPTS, params)
    assert any(fed for fed, _ in sources)  # decode steps were dispatched before the host knew their input


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bad_words_check_the_token_still_on_the_device(engines, monkeypatch, temperature):
    """A multi-token bad word's ban depends on the token before its last, which may still be on the device."""
    fast, slow = engines
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=16, ignore_eos=True)
    plain = run(slow, PROMPTS, params)
    encode = lambda word: slow.tokenizer.encode(" " + word, add_special_tokens=False)  # noqa: E731
    words = [w for out in plain for w in out[0][1].split() if len(encode(w)) > 1]
    assert words, "the outputs hold no multi-token word to ban"
    sources = spy_token_sources(monkeypatch)
    assert both(engines, PROMPTS, params.replace(bad_words=words)) != plain
    assert any(fed for fed, _ in sources)


def test_decode_inputs_come_from_the_device_while_the_host_catches_up(engines, monkeypatch):
    fast, _ = engines
    sources = spy_token_sources(monkeypatch)
    fast.add_request("in-flight", PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert fast.step() == []  # the prefill is dispatched; nothing read back yet
    assert fast.has_unfinished_requests()
    outs = []
    while not outs:  # on one device the next step; on a pipeline once the prefill has left its last stage
        outs = fast.step()  # dispatches the first decode, then reads the prefill back
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    fed, host_ids = sources[-1]
    assert fed and host_ids == [PLACEHOLDER]  # the host did not know the decode's input yet
    while fast.has_unfinished_requests():
        outs += fast.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    assert all(PLACEHOLDER not in o.outputs[0].token_ids for o in outs)


def test_abort_while_a_step_is_in_flight(engines):
    fast, slow = engines
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fast.add_request("kept", PROMPTS[0], params)
    fast.add_request("dropped", PROMPTS[1], params)
    fast.step()
    fast.step()
    fast.abort_request("dropped")
    outs = []
    while fast.has_unfinished_requests():
        outs += fast.step()
    assert {o.request_id for o in outs} == {"kept"}
    assert outs[-1].outputs[0].token_ids == slow.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    assert fast.blocks.num_free_blocks == fast.config.cache.num_blocks - 1


def spy_token_sources(monkeypatch) -> list[tuple[bool, list[int]]]:
    """Record, per step built: (whether any token is read from the device, the host ids of those tokens)."""
    seen = []
    build = plan.build_step_inputs

    def spy(*args):
        inputs, statics = build(*args)
        fed = inputs.token_source >= 0
        seen.append((bool(fed.any()), inputs.token_ids[fed].tolist()))
        return inputs, statics

    monkeypatch.setattr("jaxserve.engine.engine.build_step_inputs", spy)
    return seen


def test_a_prefix_computed_by_the_step_in_flight_is_shared_at_once(engines):
    """Blocks join the prefix cache when their step is dispatched: a request scheduled while that step is still
    in flight reuses them (the device runs its step after the one writing them)."""
    fast, slow = engines
    prompt = list(range(300, 300 + 40))  # two full blocks of 16, and a partial one
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    fast.add_request("first", prompt, params)
    fast.step()  # the first prompt's prefill is in flight
    fast.add_request("second", prompt, params)
    outs = []
    while fast.has_unfinished_requests():
        outs += fast.step(finished_only=True)
    second = next(o for o in outs if o.request_id == "second")
    assert second.num_cached_tokens == 32
    expected = slow.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in outs] == [expected, expected]


@pytest.mark.parametrize("penalties", [{}, dict(repetition_penalty=1.5, frequency_penalty=0.6)])
@pytest.mark.parametrize("where", ["read back", "inputs", "forward", "sampler"])
def test_an_interrupt_inside_a_step_loses_nothing(engines, monkeypatch, where, penalties):
    """A KeyboardInterrupt while a step is read back, while the model's program or the sampler's is dispatched
    (their first compile), or an error while the next step is built, leaves every launched step queued or in the
    pipeline: stepping on gives the synchronous engine's tokens, with no placeholder anywhere, and penalties still
    count every token (two steps were queued: the next call reads one back before it schedules). On 1x3 the
    pipeline moved on before its program ran, losing the steps in it (wrong tokens), and a step the stages had run
    was lost when its sampler was interrupted."""
    fast, slow = engines
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **penalties)
    expected = slow.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    calls = {"n": 0}

    def once_on_the_third_call(real, error):
        def wrapped(*args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise error
            return real(*args)
        return wrapped

    if where == "read back":
        monkeypatch.setattr(fast.runner, "collect", once_on_the_third_call(fast.runner.collect, KeyboardInterrupt))
    elif where in ("forward", "sampler"):
        function = {"forward": "forward_tick" if fast.stage_ticks else "forward", "sampler": "sample_rows"}[where]
        monkeypatch.setattr(fast.runner.fns, function,
                            once_on_the_third_call(getattr(fast.runner.fns, function), KeyboardInterrupt))
    else:
        monkeypatch.setattr("jaxserve.engine.engine.build_step_inputs",
                            once_on_the_third_call(plan.build_step_inputs, RuntimeError("boom")))
    fast.add_request("interrupted", PROMPTS[0], params)
    for i, prompt in enumerate(PROMPTS[1:]):  # on 1x3 a step enters the pipeline at the interrupted tick
        fast.add_request(f"beside{i}", prompt, params)
    steps = StepLog()
    fast.observers.append(steps)
    outs, raised = [], 0
    for _ in range(100):  # a step lost in the pipeline left its sequence waiting for it for ever
        if not fast.has_unfinished_requests():
            break
        try:
            outs += fast.step()
        except (KeyboardInterrupt, RuntimeError):
            raised += 1
    fast.observers.remove(steps)
    assert raised == 1 and not fast.has_unfinished_requests() and fast.runner.unsampled is None
    chunks = [(rid, start) for record in steps.records for rid, start, _ in record.chunks]
    assert len(chunks) == len(set(chunks)), "a chunk was computed twice"  # the step entering an interrupted tick
    final = {o.request_id: o for o in outs if o.finished}["interrupted"]
    assert final.outputs[0].token_ids == expected
    assert all(PLACEHOLDER not in o.outputs[0].token_ids for o in outs)
    assert fast.blocks.num_free_blocks == fast.config.cache.num_blocks - 1


def test_an_interrupted_generate_aborts_its_requests(engines, monkeypatch):
    fast, slow = engines
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    real = fast.runner.collect
    calls = {"n": 0}

    def interrupt_once(pending):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(pending)

    monkeypatch.setattr(fast.runner, "collect", interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        fast.generate(PROMPTS, params, use_tqdm=False)
    assert not fast._requests  # aborted, not left running inside the next call
    assert run(fast, PROMPTS[:2], params) == run(slow, PROMPTS[:2], params)
    assert fast.blocks.num_free_blocks == fast.config.cache.num_blocks - 1
