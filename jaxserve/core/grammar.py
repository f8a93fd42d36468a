"""Grammar matchers for constrained output (llguidance), and the token masks they give each step. Host side,
no jax.

A constrained sequence owns an `LLMatcher`: before each sampling step the matcher says which tokens may come
next, as a bitmask (bit t of word t // 32 is token t) that the sampler applies on the device; after the step it
consumes the sampled token. The mask depends on the token sampled just before, so a constrained sequence never
has a step in flight when the next one is planned (engine.py). With speculative decoding, a drafted row's mask is
the grammar's after the drafts before it (the scheduler keeps only drafts the grammar accepts).

JSON is generated on one line with ", " and ": " separators: letting the model choose whitespace freely lets a
small model emit newlines for ever without breaking the grammar.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict

import numpy as np

from jaxserve.errors import InvalidRequestField
from jaxserve.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarError(InvalidRequestField):
    """An invalid schema, regex or grammar, named by the request field it came from."""

    def __init__(self, params: StructuredOutputsParams, problem: str):
        super().__init__(f"{params.name} is invalid: {_first_line(problem)}",
                         params.source.split("[")[0].split(".")[0] if params.source else None)


class GrammarCompiler:
    """Turns a request's StructuredOutputsParams into matchers. Thread-safe: requests are prepared off the engine
    thread. The tokenizer's llguidance view is built on first use (about a second for a large vocabulary).

    Compiled matchers are kept (least recently used first out) and copied for each sequence: a client usually
    sends the same schema with every request, and a large schema takes 100 ms or more to compile."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 64):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher at the start of the output; GrammarError naming the problem for an invalid grammar."""
        grammar = _grammar_text(params)
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        compiled = self._compile(params, grammar)  # outside the lock: it may take a while
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, params: StructuredOutputsParams, grammar: str):
        import llguidance

        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(params, matcher.get_error())
        return matcher

    def _llguidance_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size,
                                                                  eos_token=self._eos or None)
            return self._ll_tokenizer


def _grammar_text(params: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return grammar_from("choice", params.choice)
    try:
        return grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(params, str(e)) from None


def _first_line(message: str) -> str:
    """llguidance's error on one line: its first line, the text it quotes after a closing colon, and the lines
    that say what is wrong ("error: unclosed group"), without the caret drawings and grammar excerpts."""
    lines = [line.strip() for line in message.strip().splitlines()]
    if not lines:
        return "unknown error"
    parts = lines[:1]
    if lines[0].endswith(":") and len(lines) > 1 and lines[1].strip("^ "):
        parts.append(lines[1])
    parts += [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(parts)


def grammar_ended(matcher, token: int, request_id: str) -> bool:
    """Feed the sampled token to the matcher; whether the output must end here: the grammar is complete and
    allows nothing more (the text stops as at EOS), or, which masking rules out, the token broke it."""
    if not matcher.consume_token(token):
        log.warning("request %s: token %d does not fit its grammar (%s); the output ends here", request_id, token,
                    _first_line(matcher.get_error()))
        return True
    return matcher.is_stopped()


def fill_masks(rows: list[tuple[int, object, list[int]]], out: np.ndarray) -> None:
    """For each (row, matcher, draft): write the matcher's allowed next tokens into `out[row]` ([B, bitmask_width]
    int32) and, for speculative decoding, those after the first i draft tokens into `out[row + i]` (the matcher
    is left as it was). Matchers run in parallel on llguidance's threads (the GIL is released)."""
    import llguidance.numpy

    drafted = [(m, row, d) for row, m, d in rows if d]  # llguidance's drafted variant refuses an empty draft
    if drafted:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(_executor(), drafted, out)
    if len(drafted) < len(rows):
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(m, row) for row, m, d in rows if not d], out)


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()
