import math

import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.allowed_token_ids is None and p.bad_words == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(2, np.int64(3)), top_k=-1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [2, 3] and all(type(t) is int for t in p.stop_token_ids)
    assert p.top_k == 0
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_logit_bias_keys_coerced_and_values_clamped():
    p = SamplingParams(logit_bias={"50256": -1000, 7: 5.5, "9": 250})
    assert p.logit_bias == {50256: -100.0, 7: 5.5, 9: 100.0}
    for key in ("²", "-1", "x"):
        with pytest.raises(ValueError, match=f"logit_bias keys must be token ids \\(integers >= 0\\), got '{key}'"):
            SamplingParams(logit_bias={key: 1})


def test_properties():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=5e-6).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties
    assert not SamplingParams().needs_top_filter
    assert SamplingParams(top_k=5).needs_top_filter
    assert SamplingParams(top_p=0.9).needs_top_filter
    assert SamplingParams(min_p=0.1).needs_top_filter
    assert SamplingParams(n=2).num_sequences == 2
    assert SamplingParams(n=2, best_of=4).num_sequences == 4


def test_replace_validates_and_clone_is_independent():
    p = SamplingParams(stop=["x"], logit_bias={1: 1.0})
    q = p.clone()
    q.stop.append("y")
    q.logit_bias[2] = 2.0
    assert p.stop == ["x"] and p.logit_bias == {1: 1.0}
    assert p.replace(temperature=0).greedy
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("best_of", 0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.1),
        ("frequency_penalty", 3),
        ("repetition_penalty", 0.0),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", 1.1),
        ("min_p", -0.1),
        ("seed", "42"),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", 5),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", 3),
        ("max_tokens", 0),
        ("max_tokens", 16.0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", True),
        ("prompt_logprobs", -1),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: "big"}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1, -2]),
        ("allowed_token_ids", "1,2"),
        ("bad_words", "word"),
        ("bad_words", ["ok", " "]),
        ("bad_words", [3]),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
        ("truncate_prompt_tokens", "8"),
    ],
)
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_p_message_gives_the_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_best_of_must_cover_n():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    assert SamplingParams(n=3, best_of=3).num_sequences == 3


def test_min_tokens_bounded_by_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


def test_truncate_prompt_keeps_the_end():
    from jaxserve.engine.inputs import truncate_prompt

    ids = list(range(10))
    assert truncate_prompt(ids, None, 8) == ids  # as given: a prompt too long for the context is refused later
    assert truncate_prompt(ids, 3, 8) == [7, 8, 9]
    assert truncate_prompt(ids, -1, 8) == ids[-7:]  # the context less one token to generate
    assert truncate_prompt(ids, 8, 8) == ids[-8:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=9 is more than .* at most 7"):
        truncate_prompt(ids, 9, 8)


def test_seed_minus_one_means_no_seed_and_every_bit_of_a_seed_counts():
    """vLLM's seed=-1 is "no seed" (random each time, not one fixed stream); a seed's bits above 32 change the
    stream (seeds 7 and 7 + 2**32 sampled alike), while seeds below 2**32 keep theirs."""
    from jaxserve.engine.inputs import sequence_seed

    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert sequence_seed(7, 0) == 7 and sequence_seed(7, 1) != 7
    seeds = {sequence_seed(s, 0) for s in (7, 7 + 2**32, 7 + 2**40, 7 - 2**32, -2, 2**32 - 2, 2**63 - 1)}
    assert len(seeds) == 7 and all(0 <= s < 2**32 for s in seeds)
