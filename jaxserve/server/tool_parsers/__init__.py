"""Tool calls a model wrote in its own format, parsed out of free text (tool_choice "auto"; vLLM's
--tool-call-parser, with its names):

- `hermes` (hermes.py): `<tool_call>{...}</tool_call>` blocks: Qwen2.5, Qwen3, QwQ, Hermes;
- `llama3_json` (or `llama4_json`) and `pythonic` (or `llama4_pythonic`) (llama.py): Llama 3.1 to 3.3's JSON calls;
  Llama 3.2 and 4's Python-style list;
- `granite`, `phi4_mini_json` and `xlam` (json_list.py): a JSON list of calls, the whole reply after Granite 3's
  `<|tool_call|>` or `<tool_call>`; after Phi-4-mini's `functools`; xLAM's, alone or fenced after some text;
- `mistral` (mistral.py): `[TOOL_CALLS]` and what follows, in both of Mistral's forms;
- `qwen3_coder` (or `qwen3_xml`) (qwen3_coder.py): Qwen3-Coder's `<function=NAME><parameter=P>` blocks, whose values
  take their types from the request's tool schemas.

A parser's `split(text, final)` gives the message's content and its calls. While streaming (`final` False) it
releases only what more tokens cannot change, so content grows and calls are only added; what is malformed
becomes content once final, so nothing the model wrote is lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from jaxserve.server.tool_parsers.common import partial_suffix
from jaxserve.server.tool_parsers.hermes import HermesToolParser
from jaxserve.server.tool_parsers.json_list import GraniteToolParser, Phi4MiniJsonToolParser, XLAMToolParser
from jaxserve.server.tool_parsers.llama import Llama3JsonToolParser, PythonicToolParser
from jaxserve.server.tool_parsers.mistral import MistralToolParser
from jaxserve.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from jaxserve.server.tools import ToolCall

if TYPE_CHECKING:
    from jaxserve.sampling_params import SamplingParams

__all__ = ["TOOL_CALL_PARSERS", "ToolParser", "partial_suffix", "tool_call_parser"]


class ToolParser(Protocol):
    def adjust(self, params: SamplingParams) -> SamplingParams:
        """The request's params as the parser needs them (e.g. special-token markers kept in the text)."""

    def for_tools(self, tools: list[dict] | None) -> ToolParser:
        """The parser for a request that offers `tools` (most parsers read every request alike)."""

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content, calls) of the reply so far."""


TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {  # --tool-call-parser NAME -> parser class (vLLM's names)
    "granite": GraniteToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "llama4_pythonic": PythonicToolParser,
    "mistral": MistralToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "xlam": XLAMToolParser,
}


def tool_call_parser(name: str | None) -> ToolParser | None:
    if name is None:
        return None
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool call parser {name!r} is not supported; supported: {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()
