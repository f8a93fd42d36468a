"""A pipeline whose stages stay busy across steps (engine._tick): in steady decode every stage works on its own
step at every tick, where running each step's micro-batches through the stages within the step (fill-drain)
leaves a stage idle on 3 of 7 ticks at pp = 4; and the tokens are one device's.

tests/engine/test_async_scheduling.py runs every async-scheduling case (sampling, n / best_of, penalties and bad
words reading tokens still on the device, stop strings, preemption, aborts, interrupts) on a ticking 3-stage
pipeline too; here: the schedule itself, and what reads the model's outputs beyond the sampled token."""

import pytest

from jaxserve import Engine, SamplingParams
from jaxserve.engine.steps import StepLog
from jaxserve.parallel.pipeline import schedule
from jaxserve.sampling_params import StructuredOutputsParams
from tests.helpers import assert_equal_up_to_rounding

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time,"]


@pytest.fixture(scope="module")
def four_layers(tiny_checkpoint):
    return str(tiny_checkpoint("llama", num_hidden_layers=4))


def test_every_stage_is_busy_on_every_tick_of_a_steady_decode(four_layers):
    engine = Engine(four_layers, mesh="1x4", max_model_len=256, max_num_seqs=8, warmup=False)
    assert engine.stage_ticks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # none ends within the 20 ticks read
    for i, prompt in enumerate(PROMPTS * 2):
        engine.add_request(str(i), prompt, params)
    outs = {}
    while len(outs) < 8:  # until every request has a token: all 8 prompts are in, the pipeline is full
        outs |= {o.request_id: o for o in engine.step()}
    before = engine.stats()
    for _ in range(20):
        outs |= {o.request_id: o for o in engine.step()}
    after = engine.stats()
    ticks = after["pipeline_ticks"] - before["pipeline_ticks"]
    busy = [b - a for a, b in zip(before["pipeline_stage_busy_ticks"], after["pipeline_stage_busy_ticks"])]
    assert ticks == 20 and all(b >= 0.9 * ticks for b in busy), (ticks, busy)
    # Each tick planned a step of 2 of the 8 sequences (a quarter each) and returned one that left the last stage.
    assert after["num_steps"] - before["num_steps"] == 20
    assert all(len(o.outputs[0].token_ids) > 4 for o in outs.values())
    # The fill-drain schedule of one step of 4 micro-batches, for comparison: each stage busy on 4 of 7 ticks.
    fill_drain = schedule(4, 4)
    assert [(fill_drain[:, s] >= 0).sum() for s in range(4)] == [4] * 4 and len(fill_drain) == 7
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step()}
    one_device = Engine(four_layers, max_model_len=256, max_num_seqs=8, warmup=False)
    expected = [o.outputs[0].token_ids for o in one_device.generate(PROMPTS * 2, params, use_tqdm=False)]
    assert [outs[str(i)].outputs[0].token_ids for i in range(8)] == expected


@pytest.fixture(scope="module")
def three_stages(tiny_checkpoint):
    """(ticking engine, synchronous engine: each step's micro-batches through the stages within it) on 1x3. The
    engines of tests/engine/test_async_scheduling.py's 1x3 case: their programs come from the compilation cache."""
    path = str(tiny_checkpoint("llama", tie_word_embeddings=False))
    kw = dict(mesh="1x3", max_model_len=128, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=32,
              warmup=False)
    return Engine(path, **kw), Engine(path, async_scheduling=False, **kw)


def outputs(engine, params):
    return [(o.prompt_logprobs, [(c.token_ids, c.logprobs, c.text) for c in o.outputs])
            for o in engine.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})),
    SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
], ids=["logprobs", "json", "choice"])
def test_logprobs_and_grammars_through_ticks(three_stages, params):
    """Prompt logprobs come from the hidden states of the step leaving the last stage; a grammar's mask, built when
    its step is planned, is the one its token is sampled with pp - 1 ticks later."""
    ticking, synchronous = three_stages
    got = outputs(ticking, params)
    assert_equal_up_to_rounding(got, outputs(synchronous, params))
    if params.prompt_logprobs:
        assert all(len(prompt) > 3 for prompt, _ in got)


def test_warm_up_compiles_every_tick_a_pipeline_runs(four_layers):
    """Warm-up compiles the tick program at each bucket, and the sampler on its outputs: serving mixed prefills
    and decodes of several sizes, whose steps meet in the stages at the largest of their buckets, compiles
    nothing more. Each step takes at most half the token budget on two stages, so a prompt's chunk never pads the
    step beside it to the whole budget."""
    engine = Engine(four_layers, mesh="1x2", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
                    recompile_guard="error")
    assert engine.stage_ticks and engine.runner.num_compiles > 0
    steps = StepLog()
    engine.observers.append(steps)
    prompts = [PROMPTS[0], PROMPTS[1] * 3, PROMPTS[2] * 6, PROMPTS[3]]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert engine.stats()["compiles_after_warmup"] == 0
    tokens = [sum(n for _, _, n in step.chunks) for step in steps.records]
    assert max(tokens) == 8 and len(steps.records) == engine.stats()["num_steps"]
