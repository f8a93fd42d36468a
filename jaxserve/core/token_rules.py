"""vLLM's `allowed_token_ids` and `bad_words`: rules on a request's next token, resolved to token ids once when
the request is prepared (host side, no jax).

The step applies them through the sampler's existing inputs: the allowed tokens as a bitmask like a grammar's
(`SamplingTensors.allowed`), and each bad word as a ban on its last token in the bias slots whenever the tokens
generated so far end with the rest of the word.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.grammar import bitmask_width
from jaxserve.errors import InvalidRequestField

ALWAYS = -1  # a ban's `after` when it holds whatever token the step in flight samples


def allowed_bitmask(token_ids: list[int], vocab_size: int) -> np.ndarray:
    """Bit t % 32 of word t // 32 set for each allowed token t ([bitmask_width] int32, as llguidance writes)."""
    bad = [t for t in token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestField(f"allowed_token_ids has token id {bad[0]}, outside the vocabulary "
                                  f"(0..{vocab_size - 1})", "allowed_token_ids")
    words = np.zeros(bitmask_width(vocab_size), np.uint32)
    ids = np.unique(np.asarray(token_ids, np.int64))
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def bad_words_token_ids(tokenizer, words: list[str], vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Each word's spellings as tokens: at the start of the text and after a space, which a byte-level BPE vocabulary
    tokenizes differently (" cat" is one token, "cat" another). Both are banned, as vLLM does."""
    spellings: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if any(t >= vocab_size for t in ids):
                raise ValueError(f"bad_words entry {word!r} tokenizes to an id outside the model's vocabulary")
            if ids and ids not in spellings:
                spellings.append(ids)
    return tuple(spellings)


def check_some_token_allowed(allowed_token_ids: list[int] | None, bad_words: tuple[tuple[int, ...], ...],
                             min_tokens: int, min_tokens_bans: set[int]) -> None:
    """Refuse rules that rule out every token: the sampler would have nothing to draw from (vLLM then samples from
    all -inf logits). One-token bad words are always banned; `min_tokens_bans` (EOS and stop tokens) until
    `min_tokens` are out."""
    if allowed_token_ids is None:
        return
    allowed = set(allowed_token_ids) - {word[0] for word in bad_words if len(word) == 1}
    if not allowed:
        raise ValueError("allowed_token_ids leaves no token that bad_words does not ban; allow more tokens or ban "
                         "fewer words")
    if min_tokens and not allowed - min_tokens_bans:
        raise ValueError(f"allowed_token_ids holds only end-of-sequence and stop tokens, which min_tokens={min_tokens} "
                         "bans until that many are out; allow other tokens or drop min_tokens")


def bad_word_bans(bad_words: tuple[tuple[int, ...], ...], outputs: list[int],
                  in_flight: bool) -> list[tuple[int, int]]:
    """The tokens to rule out next, as (token, after): a word's last token is banned when the generated tokens end
    with the rest of the word (the prompt does not count, as in vLLM). With `in_flight`, one more generated token
    is still on the device (async scheduling), not in `outputs`: a ban that depends on it holds only if that token
    turns out to be `after`, which the sampler checks; other bans have `after` ALWAYS."""
    bans = []
    for word in bad_words:
        *prefix, last = word
        if in_flight and prefix:
            *known, after = prefix
        else:
            known, after = prefix, ALWAYS
        if len(outputs) >= len(known) and outputs[len(outputs) - len(known):] == known:
            bans.append((last, after))
    return bans
