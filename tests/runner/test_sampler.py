"""The jitted sampler on its own: its argmax, and the logprob work it skips when no row asks for logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.sampler import BIAS_SLOTS, SamplerFlags, SamplingTensors, first_argmax, sample
from jaxserve.runner.top_filter import filter_top

V = 1000


def _rows_with_edge_cases() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, V)).astype(np.float32)
    x[1, [3, 500, 999]] = 10.0  # ties: the first index wins
    x[2, :] = -np.inf  # every token banned
    x[3, [7, 20]] = np.nan  # NaN counts as the maximum, the first one
    x[4, :] = np.nan
    x[5, -1] = np.inf
    x[6, :] = 0.0
    return x


def test_first_argmax_matches_jnp_argmax_on_ties_infinities_and_nans():
    x = jnp.asarray(_rows_with_edge_cases())
    got = jax.jit(first_argmax)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
    assert list(np.asarray(got)[1:7]) == [3, 0, 7, 0, V - 1, 0]


def _tensors(B: int, temperature: float, allowed: np.ndarray | None = None,
             grammar_masked: np.ndarray | None = None) -> SamplingTensors:
    return SamplingTensors(
        temperature=jnp.full(B, temperature, jnp.float32), top_k=jnp.zeros(B, jnp.int32),
        top_p=jnp.ones(B, jnp.float32), min_p=jnp.zeros(B, jnp.float32),
        seeds=jnp.arange(B, dtype=jnp.uint32), counters=jnp.zeros(B, jnp.int32),
        bias_ids=jnp.full((B, BIAS_SLOTS), V, jnp.int32), bias_values=jnp.zeros((B, BIAS_SLOTS), jnp.float32),
        bias_after=jnp.full((B, BIAS_SLOTS), -1, jnp.int32),
        history=jnp.zeros((B, 0), jnp.int32), history_is_output=jnp.zeros((B, 0), bool),
        history_fed_pos=jnp.full(B, -1, jnp.int32), fed_row=jnp.zeros(B, jnp.int32),
        presence=jnp.zeros(B, jnp.float32), frequency=jnp.zeros(B, jnp.float32), repetition=jnp.ones(B, jnp.float32),
        allowed=jnp.asarray(allowed if allowed is not None else np.zeros((B, 0), np.int32)),
        grammar_masked=jnp.asarray(grammar_masked if grammar_masked is not None else np.zeros(B, bool)))


@pytest.mark.parametrize("greedy", [True, False])
def test_skipping_logprobs_keeps_the_tokens(greedy):
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, V)).astype(np.float32) * 3)
    t = _tensors(4, 0.0 if greedy else 1.0)
    no_feed = jnp.zeros(4, jnp.int32)
    without = sample(logits, t, SamplerFlags(all_greedy=greedy, num_logprobs=-1), no_feed)
    with_lp = sample(logits, t, SamplerFlags(all_greedy=greedy, num_logprobs=3), no_feed)
    np.testing.assert_array_equal(np.asarray(without.tokens), np.asarray(with_lp.tokens))
    if greedy:
        np.testing.assert_array_equal(np.asarray(without.tokens), np.argmax(np.asarray(logits), axis=-1))
    assert without.top_ids.shape == (4, 0) and not np.asarray(without.logprobs).any()

    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    chosen = raw[np.arange(4), np.asarray(with_lp.tokens)]
    np.testing.assert_allclose(np.asarray(with_lp.logprobs), chosen, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(with_lp.ranks), (raw >= chosen[:, None]).sum(-1))
    # vLLM's ranks: a token tied with another ranks below it (both of two equal top logits are rank 2)
    tied = jnp.asarray([[1.0, 1.0, 0.0]] * 4)
    t_tied = _tensors(4, 0.0)
    ranks = sample(tied, t_tied, SamplerFlags(all_greedy=True, num_logprobs=1), no_feed).ranks
    assert np.asarray(ranks).tolist() == [2, 2, 2, 2]
    np.testing.assert_array_equal(np.asarray(with_lp.top_ids), np.argsort(-raw, axis=-1)[:, :3])


def test_warmup_variants_cover_both_logprob_modes():
    variants = SamplerFlags.all_variants(max_logprobs=20)
    assert {f.num_logprobs for f in variants} == {-1, 20}
    assert {f for f in variants if f.constrained} == {SamplerFlags.for_constrained(pen, lp) for pen in (False, True)
                                                      for lp in (-1, 20)}
    assert SamplerFlags().num_logprobs == -1


def _packed(allowed: np.ndarray) -> np.ndarray:
    """[B, V] booleans -> llguidance's bitmask: bit t % 32 of int32 word t // 32 (little-endian bit order)."""
    B = allowed.shape[0]
    padded = np.zeros((B, -(-V // 32) * 32), bool)
    padded[:, :V] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_mask_allows_exactly_its_tokens(temperature):
    rng = np.random.default_rng(2)
    B = 6
    allowed = rng.random((B, V)) < 0.05
    allowed[0, :] = False
    allowed[0, [31, 63, 999]] = True  # bit 31 of a word (the sign bit) and the last, partial word
    allowed[1, :] = True  # a row no grammar constrains
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32) * 3)
    t = _tensors(B, temperature, _packed(allowed))
    for counter in range(5):  # several random draws
        t.counters = jnp.full(B, counter, jnp.int32)
        flags = SamplerFlags.for_constrained(penalties=False, num_logprobs=-1)
        tokens = np.asarray(sample(logits, t, flags, jnp.zeros(B, jnp.int32)).tokens)
        assert allowed[np.arange(B), tokens].all(), tokens
    if temperature == 0.0:
        expected = np.argmax(np.where(allowed, np.asarray(logits), -np.inf), axis=-1)
        np.testing.assert_array_equal(tokens, expected)


def test_logprobs_of_a_grammar_row_are_over_what_its_grammar_allows():
    """As vLLM (the grammar's bitmask applied to the logits before its raw logprobs): a grammar row's logprobs
    add up to one over the tokens it allows and rank only them; a row restricted by allowed_token_ids alone, and
    a grammar row whose mask allows nothing, report the model's own distribution."""
    rng = np.random.default_rng(3)
    B = 4
    allowed = np.ones((B, V), bool)
    allowed[0] = allowed[1] = False
    allowed[0, [5, 40, 999]] = allowed[1, [5, 40, 999]] = True
    allowed[2] = False  # a grammar that allows nothing: the model's own logprobs (no NaN)
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    logits[1] = logits[0]  # the same mask and logits: as a grammar, and as allowed_token_ids
    logits = jnp.asarray(logits)
    t = _tensors(B, 0.0, _packed(allowed), grammar_masked=np.array([True, False, True, False]))
    out = sample(logits, t, SamplerFlags.for_constrained(penalties=False, num_logprobs=3), jnp.zeros(B, jnp.int32))
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    masked = np.asarray(jax.nn.log_softmax(np.where(allowed[0], np.asarray(logits[0]), -np.inf)))
    tokens = np.asarray(out.tokens)
    assert tokens[0] == tokens[1] == [5, 40, 999][int(np.argmax(np.asarray(logits[0])[[5, 40, 999]]))]
    np.testing.assert_allclose(np.asarray(out.logprobs)[0], masked[tokens[0]], rtol=1e-5)
    assert np.asarray(out.ranks)[0] == 1 and set(np.asarray(out.top_ids)[0]) == {5, 40, 999}
    np.testing.assert_allclose(np.exp(np.asarray(out.top_logprobs)[0]).sum(), 1.0, rtol=1e-5)
    for row in (1, 2, 3):  # allowed_token_ids only, an empty grammar mask, no constraint: unmasked
        np.testing.assert_allclose(np.asarray(out.logprobs)[row], raw[row, tokens[row]], rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(out.top_ids)[row], np.argsort(-raw[row])[:3])


def test_a_ban_after_a_token_in_flight_holds_only_when_that_token_came():
    """A bad word whose next-to-last token is still on the device: its ban waits for the sampled token."""
    B = 3
    logits = np.zeros((B, V), np.float32)
    logits[:, 5] = 10.0
    t = _tensors(B, 0.0)
    t.bias_ids = t.bias_ids.at[:, 0].set(5)
    t.bias_values = t.bias_values.at[:, 0].set(-1e9)
    t.bias_after = t.bias_after.at[:, 0].set(jnp.asarray([7, 7, -1]))  # row 2's ban holds whatever came
    t.fed_row = jnp.asarray([2, 0, 1], jnp.int32)  # rows of the previous step's tokens
    fed_tokens = jnp.asarray([8, 9, 7], jnp.int32)  # row 0 was fed 7 (banned), row 1 was fed 8 (not)
    tokens = np.asarray(sample(jnp.asarray(logits), t, SamplerFlags(), fed_tokens).tokens)
    assert tokens[1] == 5 and tokens[0] != 5 and tokens[2] != 5, tokens


def test_a_ban_survives_a_repetition_penalty_that_shrinks_negative_logits():
    from jaxserve.runner.plan import BAN

    B = 1
    logits = np.full((B, V), -5.0, np.float32)
    logits[0, 5] = -3.0  # the best token, banned, and seen: a tiny penalty would lift a finite ban to about 0
    t = _tensors(B, 0.0)
    t.history, t.history_is_output = jnp.asarray([[5]], jnp.int32), jnp.asarray([[True]])
    t.repetition = jnp.asarray([1e-30], jnp.float32)
    t.bias_ids = t.bias_ids.at[0, 0].set(5)
    t.bias_values = t.bias_values.at[0, 0].set(BAN)
    flags = SamplerFlags(all_greedy=True, penalties=True)
    assert int(sample(jnp.asarray(logits), t, flags, jnp.zeros(B, jnp.int32)).tokens[0]) != 5


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_constrained_variant_samples_unconstrained_rows_as_the_plain_one(temperature):
    """A constrained step runs every sampler extra: rows that use none must get the very same tokens."""
    B = 4
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((B, V)).astype(np.float32) * 3)
    everything = np.full((B, -(-V // 32)), -1, np.int32)
    plain, constrained = _tensors(B, temperature), _tensors(B, temperature, everything)
    for counter in range(8):
        plain.counters = constrained.counters = jnp.full(B, counter, jnp.int32)
        want = sample(logits, plain, SamplerFlags(all_greedy=temperature == 0.0), jnp.zeros(B, jnp.int32)).tokens
        flags = SamplerFlags.for_constrained(penalties=True, num_logprobs=-1)  # every extra: still exact
        got = sample(logits, constrained, flags, jnp.zeros(B, jnp.int32)).tokens
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_top_p_one_keeps_the_tail_that_float32_sums_round_away():
    """With one dominant logit the cumulative probability is exactly 1.0 in float32 before the tail: top_p = 1
    must still keep every token (the constrained variant filters rows that asked for no filter)."""
    logits = np.zeros((1, V), np.float32)
    logits[0, 0] = 30.0
    t = _tensors(1, 1.0)
    kept = np.asarray(filter_top(jnp.asarray(logits), t.top_k, t.top_p, t.min_p))
    np.testing.assert_array_equal(kept, logits)
