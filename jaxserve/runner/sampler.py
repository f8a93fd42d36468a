"""Sampling inside the jitted step: only token ids and the requested logprobs leave the device.

Each row has its own parameters and its own random stream, keyed by (request seed, number of tokens it has
generated), so a seeded request samples the same tokens alone or inside any batch. Logprobs are those of the
model's raw distribution (before penalties, temperature and filtering), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.runner.top_filter import filter_for

GREEDY_EPS = 1e-5
BIAS_SLOTS = 320  # logit_bias entries (OpenAI allows 300) plus EOS/stop-token bans, per row; fixed to bound compiles


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    temperature: jax.Array  # [B] f32; < GREEDY_EPS means greedy
    top_k: jax.Array  # [B] i32; 0 disables
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    seeds: jax.Array  # [B] u32
    counters: jax.Array  # [B] i32, tokens generated so far by the row's sequence
    bias_ids: jax.Array  # [B, BIAS_SLOTS] i32, padded with V (dropped); logit_bias, min_tokens and bad-word bans
    bias_values: jax.Array  # [B, BIAS_SLOTS] f32
    # -1: the bias applies; else only if the row's token sampled by the previous step (`fed_row`) is this one: a
    # bad word whose next-to-last token is still in flight (async scheduling, core/token_rules.py).
    bias_after: jax.Array  # [B, BIAS_SLOTS] i32
    history: jax.Array  # [B, P] i32 prompt+output ids for penalties, padded with V; P = max_model_len, or 0 when unused
    history_is_output: jax.Array  # [B, P] bool
    # Async scheduling: the history position (-1: none) whose id is still a placeholder on the host, and the row
    # of the previous step's sampled tokens that holds the row's last token on the device.
    history_fed_pos: jax.Array  # [B] i32
    fed_row: jax.Array  # [B] i32
    presence: jax.Array  # [B] f32
    frequency: jax.Array  # [B] f32
    repetition: jax.Array  # [B] f32
    # Structured outputs and allowed_token_ids: bit t % 32 of word t // 32 says whether token t may come next (all
    # ones in rows that are not constrained); [B, ceil(V / 32)] i32, or [B, 0] when no row is.
    allowed: jax.Array
    # [B] bool: the row's mask is a grammar's, which its logprobs see (vLLM masks the logits with the grammar before
    # its raw logprobs; allowed_token_ids alone, as logit_bias and the rest, only shape what is sampled).
    grammar_masked: jax.Array


@dataclass(frozen=True)
class SamplerFlags:
    """Static choices: each combination compiles once, and a batch that needs none of the extras pays nothing."""

    all_greedy: bool = True
    top_filter: bool = False
    penalties: bool = False
    # -1: no row asked for logprobs, so the log-softmax, ranks and top-N are skipped (about a tenth of a
    # 64-sequence CPU step); else the top-N width (rows asking for fewer are cut on the host).
    num_logprobs: int = -1
    # Some row's next token is restricted by a grammar (the `allowed` bitmask). Such steps take the sampling path and
    # the top-k/p filter (each exact for rows that do not use it), so constraining adds four programs per bucket,
    # not twelve; penalties stay a choice, since they bring a [B, max_model_len] history to the device.
    constrained: bool = False

    @classmethod
    def all_variants(cls, max_logprobs: int) -> list["SamplerFlags"]:
        """Every combination warm-up compiles (top_filter only matters when sampling)."""
        modes = [(True, False), (False, False), (False, True)]
        plain = [cls(greedy, top, pen, lp) for greedy, top in modes for pen in (False, True) for lp in (-1, max_logprobs)]
        return plain + [cls.for_constrained(pen, lp) for pen in (False, True) for lp in (-1, max_logprobs)]

    @classmethod
    def warm_variants(cls, penalties: bool) -> list["SamplerFlags"]:
        """The variants warm-up compiles at once: greedy, sampling, and sampling with top-k/p, penalised when the
        model's generation defaults give every request a penalty. The others (logprobs, penalties, structured
        output) compile the first time a step needs one: most servers never use most of them, and each costs a
        compile per sequence bucket."""
        return [cls(greedy, top, penalties, -1) for greedy, top in ((True, False), (False, False), (False, True))]

    @classmethod
    def for_constrained(cls, penalties: bool, num_logprobs: int) -> "SamplerFlags":
        return cls(all_greedy=False, top_filter=True, penalties=penalties, num_logprobs=num_logprobs, constrained=True)


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, of the chosen token (0 when flags.num_logprobs < 0)
    ranks: jax.Array  # [B] i32, 1 = most likely (0 when flags.num_logprobs < 0)
    top_ids: jax.Array  # [B, N] i32
    top_logprobs: jax.Array  # [B, N] f32


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (first index of the maximum; NaN counts as the maximum) as two plain reductions.

    XLA's CPU backend runs argmax as one reduction over (value, index) pairs that it does not vectorise: 7 ms on
    [64, 49152] logits against 1.5 ms for a max followed by a min over the matching indices.
    """
    nan = jnp.isnan(x)
    top = jnp.max(x, axis=-1, keepdims=True)  # may skip NaNs on CPU, hence the explicit check
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == top)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def _fed(t: SamplingTensors, fed_tokens: jax.Array) -> jax.Array:
    """[B, 1] each row's last token as the previous step sampled it (meaningful where the host has a placeholder)."""
    return fed_tokens[jnp.maximum(t.fed_row, 0)][:, None]


def _apply_bias(logits, t: SamplingTensors, fed_tokens: jax.Array):
    rows = jnp.arange(logits.shape[0])[:, None]
    values = jnp.where((t.bias_after < 0) | (t.bias_after == _fed(t, fed_tokens)), t.bias_values, 0.0)
    return logits.at[rows, t.bias_ids].add(values, mode="drop")


def _apply_penalties(logits, t: SamplingTensors, fed_tokens: jax.Array):
    B, V = logits.shape
    rows = jnp.arange(B)[:, None]
    # The token the previous step sampled is on the device only: put it where the host holds its placeholder.
    history = jnp.where(jnp.arange(t.history.shape[1])[None, :] == t.history_fed_pos[:, None], _fed(t, fed_tokens),
                        t.history)
    out_counts = jnp.zeros((B, V), jnp.float32).at[rows, history].add(t.history_is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((B, V), bool).at[rows, history].set(True, mode="drop")
    rep = t.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency[:, None] * out_counts - t.presence[:, None] * (out_counts > 0)


def _allowed(t: SamplingTensors, vocab: int) -> jax.Array:
    """[B, V] bool: the tokens the row's grammar (and allowed_token_ids) allow next."""
    bits = jnp.arange(32, dtype=jnp.int32)
    allowed = (t.allowed[:, :, None] >> bits[None, None, :]) & 1  # [B, W, 32]; the arithmetic shift keeps bit 31
    return allowed.reshape(allowed.shape[0], -1)[:, :vocab] != 0


def _logprob_logits(logits, t: SamplingTensors, allowed: jax.Array):
    """The logits the logprobs are of: a grammar row's masked by its grammar (`allowed`, so they rank what it may
    write and add up to one over it), unless the mask allows nothing (the sampled token is then none it allows)."""
    masks = t.grammar_masked & jnp.any(allowed, axis=-1)
    return jnp.where(masks[:, None] & ~allowed, -jnp.inf, logits)


def _gumbel(t: SamplingTensors, vocab: int):
    def one(seed, counter):
        key = jax.random.fold_in(jax.random.key(seed), counter)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    return jax.vmap(one)(t.seeds, t.counters)


def sample(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags, fed_tokens: jax.Array,
           platform: str = "cpu") -> SamplerOutput:
    """`fed_tokens`: the previous step's sampled tokens (async scheduling), which penalties and bad words may need.
    `platform`: the devices' (the top-k/p filter differs by platform, top_filter.filter_for)."""
    x = _apply_bias(logits, t, fed_tokens)
    if flags.penalties:
        x = _apply_penalties(x, t, fed_tokens)
    allowed = _allowed(t, x.shape[-1]) if flags.constrained else None
    if flags.constrained:
        x = jnp.where(allowed, x, -jnp.inf)  # rule out what the row may not write next
    tokens = first_argmax(x)
    if not flags.all_greedy:
        scaled = x / jnp.maximum(t.temperature, GREEDY_EPS)[:, None]
        if flags.top_filter:
            scaled = filter_for(platform)(scaled, t.top_k, t.top_p, t.min_p)
        sampled = first_argmax(scaled + _gumbel(t, logits.shape[-1]))
        tokens = jnp.where(t.temperature < GREEDY_EPS, tokens, sampled)
    if flags.num_logprobs < 0:
        B = tokens.shape[0]
        return SamplerOutput(tokens, jnp.zeros(B, jnp.float32), jnp.zeros(B, jnp.int32), jnp.zeros((B, 0), jnp.int32),
                             jnp.zeros((B, 0), jnp.float32))
    raw = _logprob_logits(logits, t, allowed) if flags.constrained else logits
    return SamplerOutput(tokens, *logprobs_of(raw, tokens, flags.num_logprobs))


def logprobs_of(logits: jax.Array, targets: jax.Array, num_logprobs: int):
    """Logprob and rank of each target [T] (the next prompt token, or the sampled one), plus the top-N [T, N]."""
    raw = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(raw, targets[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(raw >= chosen[:, None], axis=-1).astype(jnp.int32)  # vLLM's: a tie ranks below the others
    top_logprobs, top_ids = jax.lax.top_k(raw, num_logprobs)
    return chosen, ranks, top_ids.astype(jnp.int32), top_logprobs
