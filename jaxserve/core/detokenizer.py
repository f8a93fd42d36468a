"""Incremental detokenization and stop-string search. Host side: no jax.

Decoding one token at a time is wrong in two ways: a byte-level token may hold only part of a UTF-8 character,
and SentencePiece-style decoders drop the leading space of the first token they see. vLLM's answer, used here:
decode a short window of ids twice, with and without the new tokens, and emit the difference. The window's
first ids (the "prefix") give the new tokens their left context; the text is held back while it ends in an
incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence

# How many already-emitted ids to decode in front of the new ones, for left context (vLLM's value).
PREFIX_WINDOW = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text, one push() per step."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._rust_decode = rust_decode(tokenizer)
        self.text = ""
        self.output_token_ids: list[int] = []
        # Window ids: the last few prompt ids (so the first output token decodes with its context) + output ids.
        self._ids = list(prompt_token_ids[-PREFIX_WINDOW:])
        self._prefix_offset = 0  # where the decoded window starts
        self._read_offset = len(self._ids)  # text of ids before this point is already emitted

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ("" while a multi-byte character is unfinished)."""
        new_text = "".join(self._push_one(int(token_id)) for token_id in new_token_ids)
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """Emit the text held back in front of an unfinished character; call when the sequence ends (at its
        length limit). The unfinished character itself is dropped, as vLLM drops it, not sent as U+FFFD."""
        prefix_text, window_text = self._decode_window()
        tail = window_text[len(prefix_text) :].rstrip(REPLACEMENT_CHAR)
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += tail
        return tail

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own (for a logprob's decoded_token)."""
        tokens = self.tokenizer.convert_ids_to_tokens([int(token_id)])
        if tokens[0] is None:  # id beyond the tokenizer's vocabulary (padded embedding rows)
            return ""
        return self.tokenizer.convert_tokens_to_string(tokens)

    def _push_one(self, token_id: int) -> str:
        self.output_token_ids.append(token_id)
        self._ids.append(token_id)
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            # Nothing new yet (a skipped special token) or a character still incomplete: keep the offsets,
            # so the next push decodes these ids again together with what follows.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        """(text of the prefix ids, text of prefix + unread ids)."""
        prefix_ids = self._ids[self._prefix_offset : self._read_offset]
        window_ids = self._ids[self._prefix_offset :]
        return self._decode(prefix_ids), self._decode(window_ids)

    def _decode(self, token_ids: list[int]) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        # No clean-up of tokenization spaces: applied per window it would differ from applying it to the whole.
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def rust_decode(tokenizer):
    """The `tokenizers` library's own decode when transformers' `decode` would only forward to it, else None.

    For a fast tokenizer whose class keeps transformers' generic decode, `decode(ids, skip_special_tokens=s,
    clean_up_tokenization_spaces=False)` is exactly `backend_tokenizer.decode(ids, skip_special_tokens=s)`
    (spaces_between_special_tokens only concerns slow tokenizers), wrapped in argument conversion that costs 4x
    the decode itself: two decodes per generated token, so 30% of the host time of a 256-sequence step.
    """
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its public decode
        return None
    cls = type(tokenizer)
    generic = (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
               and cls._decode is TokenizersBackend._decode)
    return tokenizer.backend_tokenizer.decode if generic else None


def find_stop(text: str, num_new_chars: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string that completes first within the last num_new_chars characters of text: the one text
    written a character at a time would have stopped at (vLLM's rule; ties go to the stop listed first).

    Returns (start index, stop string), or None. Matches ending before the new characters were found on an
    earlier call, so they are not searched again.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        search_from = max(0, len(text) - num_new_chars - len(stop) + 1)
        start = text.find(stop, search_from)
        if start != -1 and (best is None or start + len(stop) < best[0] + len(best[1])):
            best = (start, stop)
    return best


def holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of text could be the start of a stop string (streaming holds them back)."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
