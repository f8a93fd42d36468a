"""Reasoning a model writes before its answer, split out of the text (vLLM's --reasoning-parser): a chat
response's `message.reasoning` (a stream's `delta.reasoning`) holds it, `content` the answer after it.

Both parsers read a `<think> ... </think>` block at the start of the output:

- `qwen3` (Qwen3, QwQ, SmolLM3, ...): the output is reasoning up to `</think>` when the model opens the block
  itself, or when the chat template already opened it at the end of the prompt (Qwen3-2507 Thinking, DeepSeek-R1
  distills). With thinking disabled (`enable_thinking: false` closes the block in the prompt) it is all content.
- `deepseek_r1`: as qwen3, but the output is reasoning until `</think>` even when nothing opened the block
  (vLLM's rule: early DeepSeek-R1 templates left the `<think>` to the model, which sometimes skipped it).

An output that ends (max_tokens) before `</think>` is all reasoning, with content None, as in vLLM. Constrained
output (response_format, a forced tool call) is reasoned freely first, the grammar starting after `</think>` (as
in vLLM), where `</think>` is one token of the vocabulary and the prompt did not close the block; otherwise the
grammar writes the whole output, and none of it is reasoning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.tool_parsers.common import partial_suffix

THINK_START, THINK_END = "<think>", "</think>"
# Prompt tokens decoded to see whether the template left a <think> block open: the marker and the newlines
# after it are a few tokens; more allows for a tokenizer that spells the marker out.
PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True)
class ThinkReasoningParser:
    tokenizer: Any
    implicit_start: bool  # reasoning from the first token even when nothing opened a block (deepseek_r1)
    keep_special_tokens: bool  # the tokenizer marks <think> or </think> special: keep them in the text
    end_token: int | None  # </think> as one token of the vocabulary, which a grammar can wait for

    def prompt_block(self, prompt_token_ids: list[int]) -> str | None:
        """The last think marker at the end of the prompt: "open" (the template opened a block), "closed" (it
        closed one: thinking disabled), or None."""
        tail = self.tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        start, end = tail.rfind(THINK_START), tail.rfind(THINK_END)
        return None if start == end else ("open" if start > end else "closed")

    def adjust(self, params: SamplingParams, prompt_token_ids: list[int]) -> SamplingParams:
        """The request's params for reasoning: its text keeps the markers, and, as in vLLM, a grammar (response
        format, forced tool call) starts after </think>, so the model reasons freely first; unless the prompt
        closed the block or </think> is no single token (then the grammar holds from the first token)."""
        if self.keep_special_tokens:
            params = params.replace(skip_special_tokens=False)
        if params.constrained and self.end_token is not None and self.prompt_block(prompt_token_ids) != "closed":
            after = dataclasses.replace(params.structured_outputs, starts_after_token=self.end_token)
            params = params.replace(structured_outputs=after)
        return params

    def bind(self, prompt_token_ids: list[int], params: SamplingParams) -> PromptReasoning | None:
        """This parser for one request (given its adjusted params): None when a grammar wrote the whole output."""
        if params.constrained and params.structured_outputs.starts_after_token is None:
            return None
        return PromptReasoning(self.implicit_start or self.prompt_block(prompt_token_ids) == "open")


@dataclass(frozen=True)
class PromptReasoning:
    """The reasoning parser bound to one request's prompt: whether the output starts inside a think block."""

    starts_in_block: bool

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the output so far; reasoning None when there is none. Unless `final`, only
        what more tokens cannot change: the end of the text that could begin a marker is held back, and so is
        everything while it is still unknown whether the output opens a block."""
        body = text.lstrip()
        opens = body.startswith(THINK_START)
        if not opens and not final and THINK_START.startswith(body):
            return None, ""  # "<thi" may yet open a block (or repeat the prompt's), which is not reasoning
        if not opens and not self.starts_in_block:
            return None, text
        reasoning = body[len(THINK_START):] if opens else text
        end = reasoning.find(THINK_END)
        if end >= 0:
            return reasoning[:end], reasoning[end + len(THINK_END):]
        held = 0 if final else partial_suffix(reasoning, THINK_END)
        return reasoning[: len(reasoning) - held], ""


REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}  # --reasoning-parser NAME -> implicit_start


def reasoning_parser(name: str | None, tokenizer) -> ThinkReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not supported; supported: {', '.join(REASONING_PARSERS)}")
    special = set(getattr(tokenizer, "all_special_tokens", []))
    return ThinkReasoningParser(tokenizer, REASONING_PARSERS[name], bool({THINK_START, THINK_END} & special),
                                _single_token(tokenizer, THINK_END))


def _single_token(tokenizer, text: str) -> int | None:
    """The id of the vocabulary's token spelling exactly `text`, or None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == text else None
