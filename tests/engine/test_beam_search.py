"""Beam search: transformers' `generate(num_beams=...)` on the same weights is the reference."""

from __future__ import annotations

import pytest

from jaxserve import BeamSearchParams
from jaxserve.core.beam_search import BeamSearch
from jaxserve.outputs import Logprob
from jaxserve.sampling_params import check_beam_width

EOS = 2


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (0.5, True), (2.0, "never")])
def test_beams_and_scores_match_transformers(smol_engine, hf_smollm2, length_penalty, early_stopping):
    import torch
    from transformers import GenerationConfig

    # One prompt whose beams end in EOS (the early-stop rules decide), one whose beams all reach max_tokens.
    prompts = [smol_engine.encode_chat([{"role": "user", "content": "What is 2+2? Answer with one number."}]),
               smol_engine.tokenizer.encode("The capital of France is")]
    params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outputs = smol_engine.beam_search(prompts, params, use_tqdm=False)

    eos = list(smol_engine.eos_token_ids())
    config = GenerationConfig(num_beams=3, num_return_sequences=3, max_new_tokens=12, do_sample=False,
                              length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                              pad_token_id=eos[0], return_dict_in_generate=True, output_scores=True)
    reasons = set()
    for ids, output in zip(prompts, outputs):
        x = torch.tensor([ids])
        ref = hf_smollm2.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
        assert len(output.sequences) == 3
        for seq, ref_ids, ref_score in zip(output.sequences, ref.sequences, ref.sequences_scores):
            generated = _through_first_eos(ref_ids[len(ids):].tolist(), eos)
            assert seq.generated_ids == generated
            assert seq.tokens[:len(ids)] == ids
            assert seq.score == pytest.approx(float(ref_score), abs=1e-4)
            assert seq.cum_logprob == pytest.approx(sum(lp.logprob for pos in seq.logprobs for lp in pos.values()),
                                                    abs=1e-4)
            assert seq.finish_reason == ("stop" if generated[-1] in eos else "length")
            reasons.add(seq.finish_reason)
    assert reasons == {"stop", "length"}


def _through_first_eos(ids: list[int], eos: list[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos:
            return ids[:i + 1]
    return ids


def test_text_includes_the_prompt_as_vllm_returns_it(smol_engine):
    [output] = smol_engine.beam_search(["The capital of France is"], BeamSearchParams(beam_width=2, max_tokens=4),
                                       use_tqdm=False)
    best = output.sequences[0]
    assert best.text.startswith("The capital of France is")
    assert best.text == smol_engine.tokenizer.decode(best.tokens, skip_special_tokens=True)
    assert output.sequences[0].score >= output.sequences[1].score


def test_bad_params_are_refused_by_name(smol_engine):
    for bad, field in [(dict(beam_width=0), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
                       (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
                       (dict(beam_width=2, length_penalty=float("nan")), "length_penalty")]:
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**bad)
    with pytest.raises(ValueError, match="max_logprobs"):  # 2 x 11 candidates per beam, the engine returns 20
        smol_engine.beam_search(["hi"], BeamSearchParams(beam_width=11), use_tqdm=False)
    with pytest.raises(ValueError, match="BeamSearchParams"):
        check_beam_width(object(), (EOS,), 20)


# ---- the search on made-up logprobs -------------------------------------------------------------------------

def _position(**logprobs) -> dict[int, Logprob]:
    """token id (as t<id>) -> logprob."""
    return {int(name[1:]): Logprob(value) for name, value in logprobs.items()}


def test_eos_finishes_a_beam_only_among_the_best_beam_width():
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=5), (EOS,), max_model_len=100)
    # Ranked: t5 (-0.1), t6 (-0.2), EOS (-0.3, rank 3: beyond beam_width, dropped), t9.
    search.advance([_position(t5=-0.1, t6=-0.2, t2=-0.3, t9=-0.4)])
    assert search.prompts() == [[7, 5], [7, 6]] and not search.finished
    # Now EOS after t5 ranks first: it finishes, and the next two non-EOS continuations live on.
    search.advance([_position(t2=-0.05, t3=-1.0, t4=-2.0, t8=-3.0), _position(t3=-0.1, t4=-0.2, t2=-5, t8=-6)])
    assert [h.beam.generated for h in search.finished] == [[5, 2]]
    assert search.prompts() == [[7, 6, 3], [7, 6, 4]]


@pytest.mark.parametrize("early_stopping", [True, False])
def test_early_stopping_true_ends_once_beam_width_hypotheses_finish(early_stopping):
    params = BeamSearchParams(beam_width=2, max_tokens=50, early_stopping=early_stopping)
    search = BeamSearch([7], params, (EOS,), max_model_len=100)
    search.advance([_position(t2=-0.1, t5=-0.11, t6=-0.3, t9=-0.4)])
    assert not search.done  # one finished of two
    search.advance([_position(t3=-0.02, t2=-0.05, t4=-1, t8=-2), _position(t3=-1, t4=-2, t2=-3, t8=-4)])
    assert len(search.finished) == 2
    # The live [5, 3] scores -0.13 / 2, above the worst finished (-0.1 / 1): only early_stopping=True stops.
    assert search.done is early_stopping


def test_ignore_eos_continues_through_eos_to_max_tokens():
    search = BeamSearch([7], BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True), (EOS,), 100)
    assert search.keep == 2  # no EOS to make room for
    search.advance([_position(t2=-0.1, t5=-0.2)])
    assert search.prompts() == [[7, 2]] and not search.done
    search.advance([_position(t4=-0.1, t2=-0.2)])
    assert search.done
    assert [(h.beam.generated, h.reason) for h in search.finished] == [([2, 4], "length")]


def test_max_tokens_is_capped_by_the_context():
    search = BeamSearch([1] * 98, BeamSearchParams(beam_width=1, max_tokens=None), (EOS,), max_model_len=100)
    assert search.max_new_tokens == 2
