"""Reasoning a model writes before its answer, split out of the text (vLLM's --reasoning-parser): a chat
response's `message.reasoning` (a stream's `delta.reasoning`) holds it, `content` the answer after it.

Each parser reads a block at the start of the output, between its start and end markers:

- `qwen3` (Qwen3, QwQ, SmolLM3, ...): `<think> ... </think>`; the output is reasoning up to `</think>` when the
  model opens the block itself, or when the chat template already opened it at the end of the prompt (Qwen3-2507
  Thinking, DeepSeek-R1 distills). With thinking disabled (`enable_thinking: false` closes the block in the prompt)
  it is all content.
- `deepseek_r1`: as qwen3, but the output is reasoning until `</think>` even when nothing opened the block
  (vLLM's rule: early DeepSeek-R1 templates left the `<think>` to the model, which sometimes skipped it).
- `granite` (Granite 3.2 and 3.3 with `thinking: true`): 3.2's plain-text markers, "Here is my thought process:"
  up to "Here is my response:" ("Here's" too, which quantized Granite models write, as vLLM accepts), or 3.3's
  `<think> ... </think>` followed by an answer wrapped in `<response> ... </response>`, whose tags are taken off
  the content; never read in the prompt, where they could be the user's own words.
- `openai_gptoss` (gpt-oss's harmony format): the analysis channel, `<|channel|>analysis<|message|> ... <|end|>`,
  is the reasoning; the final channel's header (`<|start|>assistant<|channel|>final<|message|>`, or
  `<|channel|>final<|message|>` when the model answers at once) and its `<|return|>` come off the answer. A grammar
  holds from the first token here: harmony's headers come before the answer, so it cannot start after `<|end|>`.

An output that ends (max_tokens) before the end marker is all reasoning, with content None, as in vLLM.
Constrained output (response_format, a forced tool call) is reasoned freely first, the grammar starting after the
end marker (as in vLLM), where that marker is one token of the vocabulary and the prompt did not close the block;
then all before the first end marker is reasoning, opened or not, so the content is what the grammar wrote.
Otherwise the grammar writes the whole output, and none of it is reasoning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.tool_parsers.common import partial_suffix

THINK_START, THINK_END = "<think>", "</think>"
# Prompt tokens decoded to see whether the template left a block open: the marker and the newlines after it are
# a few tokens; more allows for a tokenizer that spells the marker out.
PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True)
class Markers:
    """How a model opens and ends its reasoning, each in one or more spellings."""

    starts: tuple[str, ...]
    ends: tuple[str, ...]
    # Whether a chat template writes these into the prompt to open or close the block (Qwen3's <think>). Plain-text
    # markers are not read there: the user's own words could end a prompt with them.
    read_in_prompt: bool = True
    # Tags the answer comes wrapped in, taken off the content: its openings (any one of them) and its closing
    # (Granite 3.3's <response>, </response>; harmony's final-channel headers and <|return|>).
    content_tags: tuple[tuple[str, ...], str] | None = None
    # For a set joining several models' markers (Granite 3.2's phrases, 3.3's tags): (starts, ends) of each, so a
    # block is closed only by an end of the kind that opened it. Empty: any end closes any start.
    families: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()

    def for_opening(self, opening: str | None) -> Markers:
        """The markers a block opened by `opening` can end with."""
        ends = next((ends for starts, ends in self.families if opening in starts), self.ends)
        return dataclasses.replace(self, ends=ends)

    def opening(self, text: str) -> str | None:
        return next((start for start in self.starts if text.startswith(start)), None)

    def may_open(self, text: str) -> bool:
        return any(start.startswith(text) for start in self.starts)

    def first_end(self, text: str) -> tuple[int, int] | None:
        """(where, how long) of the first end marker in `text`, or None."""
        found = [(text.find(end), len(end)) for end in self.ends if end in text]
        return min(found) if found else None

    def held_end(self, text: str) -> int:
        """How much of the end of `text` could be the beginning of an end marker."""
        return max(partial_suffix(text, end) for end in self.ends)

    def unwrap(self, content: str, final: bool) -> str:
        """The content without its tags (`content_tags`). Unless `final`, what could still turn out to be a tag
        is held back: leading blanks, a partial opening tag, the start of the closing one."""
        if self.content_tags is None:
            return content
        openings, closing = self.content_tags
        body = content.lstrip()
        opening = next((o for o in openings if body.startswith(o)), None)
        if opening is None:  # an answer without the tags is left as written
            return "" if not final and any(o.startswith(body) for o in openings) else content
        content = body[len(opening):]
        cut = content.find(closing)
        if cut >= 0:
            return content[:cut] + content[cut + len(closing):]
        return content if final else content[: len(content) - partial_suffix(content, closing)]


THINK = Markers((THINK_START,), (THINK_END,))
GRANITE_32 = (("Here is my thought process:", "Here's my thought process:"),
              ("Here is my response:", "Here's my response:"))
GRANITE = Markers((*GRANITE_32[0], THINK_START), (*GRANITE_32[1], THINK_END), read_in_prompt=False,
                  content_tags=(("<response>",), "</response>"),
                  families=(GRANITE_32, ((THINK_START,), (THINK_END,))))
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY = Markers(("<|channel|>analysis<|message|>",), ("<|end|>",), read_in_prompt=False,
                  content_tags=(("<|start|>assistant" + HARMONY_FINAL, HARMONY_FINAL), "<|return|>"))


@dataclass(frozen=True)
class ReasoningParser:
    tokenizer: Any
    markers: Markers
    implicit_start: bool  # reasoning from the first token even when nothing opened a block (deepseek_r1)
    keep_special_tokens: bool  # the tokenizer marks a marker (<think>, </think>) special: keep them in the text
    end_token: int | None  # the end marker as one token of the vocabulary, which a grammar can wait for

    def prompt_block(self, prompt_token_ids: list[int]) -> str | None:
        """The last marker at the end of the prompt: "open" (the template opened a block), "closed" (it closed
        one: thinking disabled), or None."""
        if not self.markers.read_in_prompt:
            return None
        tail = self.tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        start = max(tail.rfind(marker) for marker in self.markers.starts)
        end = max(tail.rfind(marker) for marker in self.markers.ends)
        return None if start == end else ("open" if start > end else "closed")

    def adjust(self, params: SamplingParams, prompt_token_ids: list[int]) -> SamplingParams:
        """The request's params for reasoning: its text keeps the markers, and, as in vLLM, a grammar (response
        format, forced tool call) starts after the end marker, so the model reasons freely first; unless the prompt
        closed the block or the marker is no single token (then the grammar holds from the first token)."""
        if self.keep_special_tokens:
            params = params.replace(skip_special_tokens=False)
        if params.constrained and self.end_token is not None and self.prompt_block(prompt_token_ids) != "closed":
            after = dataclasses.replace(params.structured_outputs, starts_after_token=self.end_token)
            params = params.replace(structured_outputs=after)
        return params

    def bind(self, prompt_token_ids: list[int], params: SamplingParams) -> PromptReasoning | None:
        """This parser for one request (given its adjusted params): None when a grammar wrote the whole output."""
        if params.constrained:
            if params.structured_outputs.starts_after_token is None:
                return None
            # The grammar starts after the first end marker, whatever came before it (a <think> or none): the
            # text up to it is the reasoning, so the content is exactly what the grammar wrote (none if the
            # model never ended its reasoning), as vLLM splits it.
            return PromptReasoning(True, self.markers)
        return PromptReasoning(self.implicit_start or self.prompt_block(prompt_token_ids) == "open", self.markers)


@dataclass(frozen=True)
class PromptReasoning:
    """The reasoning parser bound to one request's prompt: whether the output starts inside a block."""

    starts_in_block: bool
    markers: Markers = THINK

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the output so far; reasoning None when there is none. Unless `final`, only
        what more tokens cannot change: the end of the text that could begin a marker is held back, and so is
        everything while it is still unknown whether the output opens a block."""
        body = text.lstrip()
        opening = self.markers.opening(body)
        if opening is None and not final and self.markers.may_open(body):
            return None, ""  # "<thi" may yet open a block (or repeat the prompt's), which is not reasoning
        if opening is None and not self.starts_in_block:
            return None, self.markers.unwrap(text, final)
        reasoning = text if opening is None else body[len(opening):]
        markers = self.markers.for_opening(opening)
        end = markers.first_end(reasoning)
        if end is not None:
            return reasoning[: end[0]], markers.unwrap(reasoning[end[0] + end[1]:], final)
        held = 0 if final else markers.held_end(reasoning)
        return reasoning[: len(reasoning) - held], ""


# --reasoning-parser NAME -> (its markers, whether the output is reasoning even when nothing opened a block)
REASONING_PARSERS = {"deepseek_r1": (THINK, True), "granite": (GRANITE, False), "openai_gptoss": (HARMONY, False),
                     "qwen3": (THINK, False)}


def reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not supported; supported: {', '.join(REASONING_PARSERS)}")
    markers, implicit_start = REASONING_PARSERS[name]
    special = set(getattr(tokenizer, "all_special_tokens", []))
    # A grammar can wait for one end token only: none where the model may end its reasoning in several ways, or
    # where headers come between that end and the answer (harmony).
    waits = len(markers.ends) == 1 and markers is not HARMONY
    end_token = _single_token(tokenizer, markers.ends[0]) if waits else None
    return ReasoningParser(tokenizer, markers, implicit_start, bool({*markers.starts, *markers.ends} & special),
                           end_token)


def _single_token(tokenizer, text: str) -> int | None:
    """The id of the vocabulary's token spelling exactly `text`, or None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == text else None
