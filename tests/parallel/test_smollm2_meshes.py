"""SmolLM2 (9 q heads, 3 kv heads, 30 layers: nothing divides evenly) gives the single-device greedy tokens on
every mesh: heads padded and replicated for tp, uneven zero-padded stages for pp."""

import pytest

from jaxserve import Engine, SamplingParams

PROMPTS = ["Hello, my name is", "def fibonacci(n):"]
GREEDY_8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Each tp (2, 4, 8: the 3 kv and 9 q heads padded differently for each) and each pp (2, 4, 8: 30 layers never split
# evenly) at least once, tp alone (no pipeline) and pp alone too. Other meshes repeat these paddings, and each mesh
# costs a real-model engine (~15 s on two CPU cores).
MESHES = ["8x1", "1x8", "4x2", "2x4"]


@pytest.fixture(scope="module")
def single_device_tokens(smol_engine):
    return [o.outputs[0].token_ids for o in smol_engine.generate(PROMPTS, GREEDY_8, use_tqdm=False)]


@pytest.mark.parametrize("mesh", MESHES)
def test_greedy_tokens_match_one_device(mesh, smollm2_gguf_path, single_device_tokens, shared_checkpoints):
    engine = Engine(smollm2_gguf_path, mesh=mesh, max_model_len=128, num_kv_blocks=32, max_num_seqs=4,
                    max_num_batched_tokens=16, warmup=False)
    outs = engine.generate(PROMPTS, GREEDY_8, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == single_device_tokens
