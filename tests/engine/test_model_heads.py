"""Checkpoints whose decoder feeds no LM head (loader/heads.py), each against transformers on the same weights:
- base models saved by `AutoModel` (e5-mistral's and Qwen3-Embedding's layout: no "model." prefix) embed;
- a config that is not tied but ships no lm_head.weight embeds and refuses generation;
- sequence classifiers classify (`Engine.classify`), and a one-label classifier scores pairs as a cross-encoder.
"""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel, AutoTokenizer

from jaxserve import Engine, PoolingParams, SamplingParams
from tests.helpers import make_tiny_classifier

PROMPTS = [list(range(300, 341)), list(range(100, 105)), [7]]  # the first runs in three chunks of 16
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _engine(path, **options) -> Engine:
    return Engine(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
                  warmup=False, **options)


def _rewrite_config(path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | fields))


@pytest.fixture(scope="module")
def causal(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def base_model(causal, tmp_path_factory):
    """The causal checkpoint's decoder saved as transformers' `Qwen3Model` (no LM head, no "model." prefix)."""
    out = tmp_path_factory.mktemp("base")
    model = AutoModel.from_pretrained(causal, dtype=torch.float32).eval()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(causal).save_pretrained(out)
    with torch.no_grad():
        hidden = [model(torch.tensor([p])).last_hidden_state[0, -1].numpy() for p in PROMPTS]
    return out, model, [h / np.linalg.norm(h) for h in hidden]


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_a_base_model_checkpoint_embeds_as_transformers_and_does_not_generate(base_model, tmp_path):
    path, _, references = base_model
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    with safe_open(path / "model.safetensors", "np") as f:
        assert "embed_tokens.weight" in f.keys() and not any(name.startswith("lm_head") for name in f.keys())
    engine = _engine(path)
    for out, ref in zip(engine.embed(PROMPTS, use_tqdm=False), references):
        np.testing.assert_allclose(out.outputs.embedding, ref, atol=1e-5)
    # vLLM's LLM.encode names the task; the task in the parameters given is replaced by it
    encoded = engine.encode(PROMPTS[1:2], PoolingParams(normalize=False, task="classify"), pooling_task="embed",
                            use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(encoded / np.linalg.norm(encoded), references[1], atol=1e-5)
    assert abs(np.linalg.norm(encoded) - 1) > 1e-3, "normalize=False was not kept"
    for task in (None, "token_embed"):
        with pytest.raises(ValueError, match=f"pooling_task must be 'embed' or 'classify' \\(got {task!r}\\)"):
            engine.encode(PROMPTS[:1], pooling_task=task, use_tqdm=False)
    with pytest.raises(ValueError, match="has no language-model head .* serves embeddings"):
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="no classification head"):
        engine.classify(PROMPTS[:1], use_tqdm=False)
    from jaxserve.runner.convert import convert

    with pytest.raises(ValueError, match="not a causal language model"):  # what it would write could not embed
        convert(str(path), str(tmp_path / "converted"), (1, 1), "float32")


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_embedding_layout_loads_under_its_causal_config(base_model, causal, tmp_path, tied):
    """Qwen3-Embedding's files: a Qwen3Model's tensors under a Qwen3ForCausalLM config; the 0.6B ties the
    embeddings (so it has an LM head), the 8B says untied and ships no lm_head.weight (so it has none)."""
    path, _, references = base_model
    for file in path.iterdir():
        (tmp_path / file.name).symlink_to(file) if file.name != "config.json" else None
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    _rewrite_config(tmp_path, architectures=["Qwen3ForCausalLM"], tie_word_embeddings=tied)
    engine = _engine(tmp_path)
    np.testing.assert_allclose(engine.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding, references[0],
                               atol=1e-5)
    if tied:  # the tied embeddings are its LM head: it generates as transformers' causal model of those weights
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        want = hf.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=4, do_sample=False)[0, 5:].tolist()
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert engine.generate(PROMPTS[1:2], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    else:
        with pytest.raises(ValueError, match="no lm_head.weight"):
            engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_sequence_classifier_classifies_as_transformers(causal, tmp_path):
    hf = make_tiny_classifier(causal, tmp_path, 3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    engine = _engine(tmp_path, mesh="2x2")
    outs = engine.classify(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        logits = _hf_logits(hf, prompt)
        want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert out.finished and out.prompt_token_ids == prompt and out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, want, atol=1e-5)
        assert out.outputs.label == LABELS[int(np.argmax(logits))]
    assert len({out.outputs.label for out in outs}) > 1, "the head should not give every prompt the same class"
    encoded = engine.encode(PROMPTS, pooling_task="classify", use_tqdm=False)
    assert [out.outputs.probs for out in encoded] == [out.outputs.probs for out in outs]
    truncated = engine.classify(PROMPTS[:1], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert truncated.prompt_token_ids == PROMPTS[0][:5]  # the first k, as vLLM 0.34 truncates pooling prompts
    np.testing.assert_allclose(truncated.outputs.probs, engine.classify([PROMPTS[0][:5]], use_tqdm=False)[0]
                               .outputs.probs, atol=1e-6)
    # a pooling prompt may fill the whole context (no token is generated after it), and -1 keeps that much
    whole = list(range(300, 300 + engine.max_model_len + 7))
    assert engine.classify([whole[: engine.max_model_len]], use_tqdm=False)[0].finished
    assert engine.classify([whole], truncate_prompt_tokens=-1, use_tqdm=False)[0].prompt_token_ids == \
        whole[: engine.max_model_len]
    with pytest.raises(ValueError, match="maximum context length"):
        engine.classify([whole[: engine.max_model_len + 1]], use_tqdm=False)
    for refused, call in (("is a sequence classifier .* does not generate",
                           lambda: engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)),
                          ("does not embed", lambda: engine.embed(PROMPTS[:1], use_tqdm=False)),
                          ("needs a cross-encoder .* has 3 labels", lambda: engine.score("a", "b", use_tqdm=False))):
        with pytest.raises(ValueError, match=refused):
            call()


def test_a_one_label_classifier_scores_pairs_as_a_cross_encoder(causal, tmp_path):
    """vLLM's cross-encoder scoring: each pair is one prompt (the tokenizer's pair encoding) and its score is the
    sigmoid of the classifier's one logit."""
    hf = make_tiny_classifier(causal, tmp_path, 1)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    engine = _engine(tmp_path)
    query, documents = "What is the capital of France?", ["Paris is its capital.", "Cats purr.", "A tall tree."]
    scores = engine.score(query, documents, use_tqdm=False)
    for out, document in zip(scores, documents):
        ids = tokenizer(query, document)["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(float(torch.sigmoid(torch.tensor(_hf_logits(hf, ids)[0]))),
                                                  abs=1e-5)
    assert len({round(out.outputs.score, 4) for out in scores}) == 3
    pairwise = engine.score([PROMPTS[1], PROMPTS[2]], [PROMPTS[2], PROMPTS[1]], use_tqdm=False)
    assert [out.prompt_token_ids for out in pairwise] == [PROMPTS[1] + PROMPTS[2], PROMPTS[2] + PROMPTS[1]]
    with pytest.raises(ValueError, match="two texts or two token-id lists"):
        engine.score("a text", [PROMPTS[1]], use_tqdm=False)
    probs = engine.classify([tokenizer(query, documents[0])["input_ids"]], use_tqdm=False)[0].outputs.probs
    assert probs == [pytest.approx(scores[0].outputs.score, abs=1e-6)]


def test_pooling_params_refuse_what_classification_cannot_do():
    with pytest.raises(ValueError, match="dimensions applies to embeddings"):
        PoolingParams(task="classify", dimensions=8)
    with pytest.raises(ValueError, match="task must be one of 'embed', 'classify'"):
        PoolingParams(task="generate")


@pytest.mark.parametrize("problem_type, activation", [("multi_label_classification", "sigmoid"),
                                                      ("regression", "identity")])
def test_the_problem_type_picks_the_activation(causal, tmp_path, problem_type, activation):
    """As transformers' problem_type (and vLLM): a sigmoid per label for multi-label, the logits for regression."""
    hf = make_tiny_classifier(causal, tmp_path, 3 if activation == "sigmoid" else 1, problem_type=problem_type)
    logits = _hf_logits(hf, PROMPTS[1])
    want = 1 / (1 + np.exp(-logits)) if activation == "sigmoid" else logits
    np.testing.assert_allclose(_engine(tmp_path).classify(PROMPTS[1:2], use_tqdm=False)[0].outputs.probs, want,
                               atol=1e-5)


@pytest.mark.parametrize("config, labels, activation", [
    ({}, 1, "sigmoid"), ({}, 3, "softmax"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, 1, "tanh"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, 1, "identity"),  # older CEs
    # the problem type first, as vLLM (a regression stays the logits whatever activation_fn says)
    ({"problem_type": "regression", "sentence_transformers": {"activation_fn": "torch.nn.Sigmoid"}}, 1, "identity"),
    ({"problem_type": "single_label_classification"}, 3, "softmax"),
])
def test_the_activation_is_chosen_as_vllm_chooses_it(config, labels, activation):
    from jaxserve.loader.heads import _activation

    assert _activation(config, labels) == activation


def test_an_activation_it_cannot_apply_is_refused_by_name():
    from jaxserve.loader.heads import _activation

    with pytest.raises(ValueError, match="activation torch.nn.modules.activation.GELU is not one jaxserve applies"):
        _activation({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.GELU"}}, 1)


def test_dummy_weights_keep_the_head(base_model, causal, tmp_path):
    """load_format="dummy" reads no tensors, yet a base model (tied or not) still does not generate, and a
    classifier classifies into its config's labels."""
    path, _, _ = base_model
    for file in path.iterdir():
        if file.name != "config.json":
            (tmp_path / file.name).symlink_to(file)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    _rewrite_config(tmp_path, tie_word_embeddings=True)
    for load_format in ("auto", "dummy"):
        with pytest.raises(ValueError, match="has no language-model head"):
            _engine(tmp_path, load_format=load_format).generate(PROMPTS[:1], SamplingParams(max_tokens=2),
                                                                use_tqdm=False)
    classifier = tmp_path / "classifier"
    make_tiny_classifier(causal, classifier, 3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    out = _engine(classifier, load_format="dummy").classify(PROMPTS[:1], use_tqdm=False)[0].outputs
    assert out.num_classes == 3 and out.label in LABELS.values() and sum(out.probs) == pytest.approx(1)


def test_a_pair_is_the_tokenizers_pair_encoding_and_truncates_as_one(causal, tmp_path):
    """A tokenizer that marks the pair (a separator between the texts, as Llama's BOS or BERT's SEP): the pair
    prompt has it, and truncation shortens the longer text, keeping the query and the special tokens."""
    from tokenizers.processors import TemplateProcessing

    hf = make_tiny_classifier(causal, tmp_path, 1)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    separator = tokenizer.convert_ids_to_tokens(0)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="$A", pair=f"$A {separator} $B", special_tokens=[(separator, 0)])
    tokenizer.save_pretrained(tmp_path)
    query, document = "Where is it?", "It is in the big old house at the end of the long and winding road. " * 3
    pair = tokenizer(query, document)["input_ids"]
    assert pair == tokenizer(query)["input_ids"] + [0] + tokenizer(document)["input_ids"]
    engine = _engine(tmp_path)
    out = engine.score(query, [document], use_tqdm=False)[0]
    assert out.prompt_token_ids == pair
    assert out.outputs.score == pytest.approx(float(torch.sigmoid(torch.tensor(_hf_logits(hf, pair)[0]))), abs=1e-5)
    truncated = engine.score(query, [document], truncate_prompt_tokens=20, use_tqdm=False)[0].prompt_token_ids
    assert truncated == tokenizer(query, document, truncation=True, max_length=20)["input_ids"]
    assert len(truncated) == 20 and truncated[: len(tokenizer(query)["input_ids"]) + 1] == \
        tokenizer(query)["input_ids"] + [0]
    # -1: the longest prompt the context holds; without truncation the pair is too long.
    longer = document * 10
    with pytest.raises(ValueError, match="maximum context length"):
        engine.score(query, [longer], use_tqdm=False)
    fitted = engine.score(query, [longer], truncate_prompt_tokens=-1, use_tqdm=False)[0].prompt_token_ids
    assert fitted == tokenizer(query, longer, truncation=True, max_length=engine.max_model_len)["input_ids"]
    # the tokenizers library's longest_first cut for every budget: the shorter keeps at most half, rounded down
    documents = ["It is in the big old house.", "Far."]
    for limit in range(3, 24):
        cuts = engine.score(query, documents, truncate_prompt_tokens=limit, use_tqdm=False)
        assert [cut.prompt_token_ids for cut in cuts] == \
            [tokenizer(query, document, truncation=True, max_length=limit)["input_ids"] for document in documents]
    # Token-id pairs are joined, the longer list shortened first.
    ids = engine.score([7, 8], [list(range(100, 110))], truncate_prompt_tokens=6, use_tqdm=False)[0]
    assert ids.prompt_token_ids == [7, 8, 100, 101, 102, 103]


@pytest.mark.parametrize("two_way", [True, False])
def test_a_causal_lm_served_as_a_classifier_reads_its_lm_head_rows(causal, two_way):
    """vLLM's way to serve Qwen3-Reranker (hf_overrides: a classifier architecture, classifier_from_token and
    is_original_qwen3_reranker): the head is the LM head's rows of the tokens; two-way, its one score is the
    softmax of the no/yes logits' probability of yes. Otherwise each token is a label."""
    from transformers import AutoModelForCausalLM

    # Qwen3-Reranker's are "no" and "yes"; the tiny checkpoints' vocabulary (its first 1024 ids) has neither, so
    # two of its tokens stand in for them.
    tokens = ["in", "on"] if two_way else ["in", "on", "at"]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens,
                 "is_original_qwen3_reranker": two_way}
    engine = _engine(causal, hf_overrides=overrides)
    hf = AutoModelForCausalLM.from_pretrained(causal, dtype=torch.float32).eval()
    logits = _hf_logits(hf, PROMPTS[1])[-1][AutoTokenizer.from_pretrained(causal).convert_tokens_to_ids(tokens)]
    want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    out = engine.classify(PROMPTS[1:2], use_tqdm=False)[0].outputs
    np.testing.assert_allclose(out.probs, want[1:] if two_way else want, atol=1e-5)
    assert out.label == ("on" if two_way else tokens[int(np.argmax(logits))])
    with pytest.raises(ValueError, match="does not generate"):
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    if two_way:  # a scored pair is the two texts joined as one text, as vLLM encodes it for an LLM reranker
        tokenizer = AutoTokenizer.from_pretrained(causal)
        query, document = "Where is it? ", "In the house."
        scored = engine.score(query, [document], use_tqdm=False)[0]
        assert scored.prompt_token_ids == tokenizer(query + document)["input_ids"]
    with pytest.raises(ValueError, match="'qqzzxx' is not a token of this model's tokenizer"):
        _engine(causal, hf_overrides=overrides | {"classifier_from_token": ["in", "qqzzxx"]})
