"""Embedding requests (PoolingParams): the final hidden state at the prompt's last token, as transformers'
`last_hidden_state` on the same weights, on one device and a 2x2 mesh, over chunked prompts, batched with
generating requests that stay unchanged."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel

from jaxserve import Engine, PoolingParams, SamplingParams
from jaxserve.engine.steps import StepLog

PROMPTS = [list(range(300, 341)), list(range(100, 105)), [7]]  # 41 tokens run in three chunks of 16


def last_hidden_states(path, prompts) -> list[np.ndarray]:
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0, -1].numpy() for p in prompts]


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    return path, last_hidden_states(path, PROMPTS)


@pytest.mark.parametrize("mesh", [None, "2x2"])
def test_embeddings_are_transformers_last_hidden_state_normalized(qwen3, mesh):
    path, references = qwen3
    engine = Engine(str(path), mesh=mesh, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
                    max_num_seqs=4, warmup=False)
    outs = engine.embed(PROMPTS, use_tqdm=False)
    for prompt, out, ref in zip(PROMPTS, outs, references):
        assert out.finished and out.prompt_token_ids == prompt
        np.testing.assert_allclose(out.outputs.embedding, ref / np.linalg.norm(ref), atol=1e-5)
    if mesh is None:
        # An embedding's prompt blocks join the prefix cache, its last chunk's too (48 tokens: chunks end at 16, 32, 48).
        whole_blocks = list(range(500, 548))
        engine.embed([whole_blocks], use_tqdm=False)
        assert engine.embed([whole_blocks + [9]], use_tqdm=False)[0].num_cached_tokens == 48
        raw = engine.embed(PROMPTS[:1], PoolingParams(dimensions=8, normalize=False), use_tqdm=False)[0]
        np.testing.assert_allclose(raw.outputs.embedding, references[0][:8], atol=1e-4)
        assert len(engine.embed(PROMPTS[:1], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding) == 8
        # truncate_prompt_tokens keeps the first k tokens, as vLLM 0.34's pooling tokenizers truncate (right side)
        start = engine.embed([PROMPTS[0][:5]], use_tqdm=False)[0]
        truncated = engine.embed(PROMPTS[:1], PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)[0]
        assert truncated.prompt_token_ids == PROMPTS[0][:5]
        np.testing.assert_allclose(truncated.outputs.embedding, start.outputs.embedding, atol=1e-6)
        for bad, message in ((dict(dimensions=10_000), "more than the model's"), (dict(dimensions=0), "positive")):
            with pytest.raises(ValueError, match=message):
                engine.embed(PROMPTS[:1], PoolingParams(**bad), use_tqdm=False)


def test_embedding_and_generating_requests_share_steps(qwen3):
    path, references = qwen3
    engine = Engine(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                    warmup=False)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = engine.generate(PROMPTS[1:2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    steps = StepLog()
    engine.observers.append(steps)
    engine.add_request("gen", PROMPTS[1], greedy)
    engine.add_request("emb", PROMPTS[0], PoolingParams())
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    assert any({"gen", "emb"} <= {rid for rid, _, _ in record.chunks} for record in steps.records)
    assert finals["gen"].outputs[0].token_ids == alone
    np.testing.assert_allclose(finals["emb"].outputs.embedding, references[0] / np.linalg.norm(references[0]),
                               atol=1e-5)


@pytest.mark.parametrize("mode, refused", [("pooling_mode_lasttoken", False), ("pooling_mode_mean_tokens", True)])
def test_a_model_that_declares_another_pooling_is_refused_by_name(qwen3, tmp_path, mode, refused):
    """sentence-transformers checkpoints name their pooling: embedding by the last token where the model was trained
    to mean-pool would give vectors it was not trained to give."""
    path, _ = qwen3
    for file in path.iterdir():
        (tmp_path / file.name).symlink_to(file)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({mode: True, "word_embedding_dimension": 64}))
    engine = Engine(str(tmp_path), dtype="float32", num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=2,
                    warmup=False)
    if refused:
        with pytest.raises(ValueError, match="pools by mean, and jaxserve embeds by the last token only"):
            engine.embed(PROMPTS[:1], use_tqdm=False)
        assert engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished  # still generates
    else:
        assert len(engine.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding) == 64


ST6 = "sentence_transformers.sentence_transformer.modules"


@pytest.mark.parametrize("modules, pooling_config, declared", [
    ([("1_Pooling", "sentence_transformers.models.Pooling")], {"pooling_mode_cls_token": True}, "cls"),
    # sentence-transformers 6 moved the classes and writes the mode as one string: it read as no pooling at all
    ([("1_Pooling", f"{ST6}.pooling.Pooling")], {"pooling_mode": "mean"}, "mean"),
    ([("1_Pooling", f"{ST6}.pooling.Pooling")], {"pooling_mode": "lasttoken"}, "lasttoken"),
    ([("1_Pooling", f"{ST6}.pooling.Pooling")], {"pooling_mode": "cls"}, "cls"),
    # a projection after the pooling changes the vector's size and values: declared, so embedding is refused
    ([("1_Pooling", f"{ST6}.pooling.Pooling"), ("2_Dense", "sentence_transformers.base.modules.dense.Dense")],
     {"pooling_mode": "lasttoken"}, "lasttoken, then a Dense projection"),
    ([("1_Pooling", "sentence_transformers.models.Pooling"), ("2_Dense", "sentence_transformers.models.Dense")],
     {"pooling_mode_lasttoken": True}, "lasttoken, then a Dense projection"),
])
def test_the_declared_pooling_is_read_from_either_sentence_transformers_layout(tmp_path, modules, pooling_config,
                                                                               declared):
    from jaxserve.loader.pooling import declared_pooling

    listed = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    listed += [{"idx": i, "name": str(i), "path": path, "type": kind} for i, (path, kind) in enumerate(modules, 1)]
    (tmp_path / "modules.json").write_text(json.dumps(listed))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    assert declared_pooling(tmp_path) == declared


def test_score_is_the_cosine_of_transformers_embeddings(qwen3):
    """Engine.score (vLLM's LLM.score for an embedding model): one text against each of the others, or pairwise."""
    path, references = qwen3
    engine = Engine(path, max_model_len=128, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
                    warmup=False)

    def cosine(a, b):
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    one_to_many = engine.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
    want = [cosine(references[0], references[k]) for k in (1, 2)]
    np.testing.assert_allclose([out.outputs.score for out in one_to_many], want, atol=1e-5)
    assert one_to_many[1].prompt_token_ids == PROMPTS[0] + PROMPTS[2]
    pairwise = engine.score(PROMPTS[:2], PROMPTS[1:], use_tqdm=False)
    want = [cosine(references[0], references[1]), cosine(references[1], references[2])]
    np.testing.assert_allclose([out.outputs.score for out in pairwise], want, atol=1e-5)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        engine.score(PROMPTS[:2], PROMPTS, use_tqdm=False)
