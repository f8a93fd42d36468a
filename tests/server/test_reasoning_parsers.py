"""--reasoning-parser: <think> blocks (and Granite's plain-text markers and <response> tags) split into the chat message's `reasoning`,
whole and streamed."""

import copy
import json
from types import SimpleNamespace

import openai
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.server.app import build_app
from jaxserve.server.reasoning_parsers import GRANITE, HARMONY, PromptReasoning, reasoning_parser
from jaxserve.server.tool_parsers.hermes import HermesToolParser
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import serve_in_thread
from tests.server.test_tool_parsers import REPLY
from tests.server.test_tools import TOOLS

THOUGHT = "\nThe user asks about weather. I should look it up.\n"
THINKING = f"<think>{THOUGHT}</think>\n\nIt is sunny."


@pytest.mark.parametrize("text, starts_in_block, expected", [
    (THINKING, False, (THOUGHT, "\n\nIt is sunny.")),  # the model opens the block (Qwen3)
    (f"{THOUGHT}</think>Sunny.", True, (THOUGHT, "Sunny.")),  # the template opened it (Qwen3-2507 Thinking, R1)
    (f"\n<think>{THOUGHT}</think>Sunny.", True, (THOUGHT, "Sunny.")),  # ... and the model opens it again
    ("It is sunny.", False, (None, "It is sunny.")),  # thinking disabled: no block, all content
    (f"<think>{THOUGHT}", False, (THOUGHT, "")),  # max_tokens ended it mid-thought
    ("", True, ("", "")),
])
def test_a_finished_output_splits_into_reasoning_and_content(text, starts_in_block, expected):
    assert PromptReasoning(starts_in_block).split(text, final=True) == expected


@pytest.mark.parametrize("text, starts_in_block", [(THINKING, False), (THINKING[7:], True), ("Plain <th", False),
                                                   ("<th", False), ("<think>a</thinking>b</think>c", False)])
def test_while_streaming_each_part_only_grows(text, starts_in_block):
    """A streamed part is never taken back: a partial marker is held back until it is settled."""
    bound = PromptReasoning(starts_in_block)
    final_reasoning, final_content = bound.split(text, final=True)
    for n in range(len(text) + 1):
        reasoning, content = bound.split(text[:n], final=False)
        assert final_content.startswith(content), (n, content)
        assert reasoning is None or (final_reasoning or "").startswith(reasoning), (n, reasoning)
    assert bound.split("<think>ab</thi", final=False) == ("ab", "")
    assert bound.split(" <thi", final=False) == (None, "")  # may yet open a block


HARMONY_REPLY = ("<|channel|>analysis<|message|>The user wants the weather.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>")


@pytest.mark.parametrize("text, expected", [
    (HARMONY_REPLY, ("The user wants the weather.", "It is sunny.")),
    ("<|channel|>final<|message|>It is sunny.", (None, "It is sunny.")),  # no analysis: the final channel at once
    ("<|channel|>analysis<|message|>still thinking", ("still thinking", "")),  # cut by max_tokens
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b",  # stopped at <|return|>
     ("a", "b")),
    ("Plain text.", (None, "Plain text.")),
])
def test_harmony_channels_split_reasoning_from_the_answer(text, expected):
    """gpt-oss's harmony format (`openai_gptoss`, vLLM's name): the analysis channel is the reasoning, the final
    channel's headers come off the answer."""
    assert PromptReasoning(False, HARMONY).split(text, final=True) == expected


def test_harmony_streamed_parts_only_grow():
    bound = PromptReasoning(False, HARMONY)
    final_reasoning, final_content = bound.split(HARMONY_REPLY, final=True)
    for n in range(len(HARMONY_REPLY) + 1):
        reasoning, content = bound.split(HARMONY_REPLY[:n], final=False)
        assert final_content.startswith(content), (n, content)
        assert reasoning is None or final_reasoning.startswith(reasoning), (n, reasoning)
        assert "<|" not in content and "<|" not in (reasoning or ""), (n, reasoning, content)


def test_harmony_parser_keeps_special_tokens_and_lets_a_grammar_hold_from_the_start(tokenizer):
    special = copy.deepcopy(tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<|end|>", "<|channel|>", "<|message|>"]})
    parser = reasoning_parser("openai_gptoss", special)
    assert parser.keep_special_tokens and parser.end_token is None
    assert parser.adjust(SamplingParams(), [1]).skip_special_tokens is False


GRANITE_REPLY = "Here is my thought process:\nWeather needs a lookup.\nHere is my response:\nIt is sunny."


@pytest.mark.parametrize("text, expected", [
    (GRANITE_REPLY, ("\nWeather needs a lookup.\n", "\nIt is sunny.")),
    ("Here's my thought process: a. Here's my response: b", (" a. ", " b")),  # as quantized Granites write it
    ("Here is my thought process: a. Here's my response: b", (" a. ", " b")),
    ("It is sunny.", (None, "It is sunny.")),  # thinking off: no markers, all content
    ("Here is my thought process: still thinking", (" still thinking", "")),  # cut by max_tokens
    ("Here is the weather.", (None, "Here is the weather.")),
    # Granite 3.3: <think> blocks, the answer wrapped in <response> tags, which come off.
    ("<think>Weather needs a lookup.</think><response>It is sunny.</response>", ("Weather needs a lookup.",
                                                                                 "It is sunny.")),
    ("<think>a</think>\n<response>\nb\n</response>", ("a", "\nb\n")),
    ("<response>b</response>", (None, "b")),  # thinking off
    ("<think>a</think>b <response> c", ("a", "b <response> c")),  # a tag inside the answer is the answer's
    ("<think>still thinking", ("still thinking", "")),
    # A block ends only with its own kind of end; tags are taken off only an answer that opens with them.
    ("<think>I think. Here is my response: no</think><response>ok</response>", ("I think. Here is my response: no",
                                                                                "ok")),
    ("Here is my thought process: a</think>b Here is my response: c", (" a</think>b ", " c")),
    ("Use the </response> tag.", (None, "Use the </response> tag.")),
])
def test_granite_markers_split_reasoning_from_the_answer(tokenizer, text, expected):
    bound = reasoning_parser("granite", tokenizer).bind(tokenizer.encode("<|im_start|>assistant\n"), SamplingParams())
    assert bound == PromptReasoning(False, GRANITE)
    assert bound.split(text, final=True) == expected
    for n in range(len(text) + 1):  # while streaming each part only grows
        reasoning, content = bound.split(text[:n], final=False)
        assert expected[1].startswith(content), (n, content)
        assert reasoning is None or (expected[0] or "").startswith(reasoning), (n, reasoning)
    assert bound.split("Here is my thought process: a Here is my resp", final=False) == (" a ", "")
    assert bound.split("Here is", final=False) == (None, "")  # may yet open the block
    # The markers are not read in the prompt, where they may be the user's own words.
    asked = tokenizer.encode("<|im_start|>user\nFinish this: Here is my thought process:<|im_end|>\n")
    assert reasoning_parser("granite", tokenizer).bind(asked, SamplingParams()).starts_in_block is False


@pytest.mark.parametrize("reply, expected", [
    (GRANITE_REPLY, ("\nWeather needs a lookup.\n", "\nIt is sunny.")),  # Granite 3.2
    ("<think>Weather needs a lookup.</think>\n<response>It is sunny.</response>",  # Granite 3.3
     ("Weather needs a lookup.", "It is sunny.")),
])
def test_granite_reasoning_served_whole_and_streamed(tokenizer, reply, expected):
    with _client(tokenizer, reply, reasoning_parser=reasoning_parser("granite", tokenizer)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        n = len(tokenizer.encode(reply))
        message = _chat(client, max_tokens=n).choices[0].message
        chunks = [c.choices[0] for c in _chat(client, stream=True, max_tokens=n) if c.choices]
    assert (message.reasoning, message.content) == expected
    assert "".join(getattr(c.delta, "reasoning", None) or "" for c in chunks) == message.reasoning
    assert "".join(c.delta.content or "" for c in chunks) == message.content


def test_the_prompt_says_where_the_output_starts(tokenizer):
    """Read from the prompt's last tokens: a template that opened <think> (and did not close it) starts the output
    inside the block; Qwen3's enable_thinking=False closes it in the prompt; deepseek_r1 starts inside regardless."""
    qwen3, r1 = reasoning_parser("qwen3", tokenizer), reasoning_parser("deepseek_r1", tokenizer)
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n")
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = tokenizer.encode("<|im_start|>assistant\n")
    params = SamplingParams()
    assert [qwen3.bind(ids, params).starts_in_block for ids in (opened, closed, plain)] == [True, False, False]
    assert [r1.bind(ids, params).starts_in_block for ids in (opened, closed, plain)] == [True, True, True]
    # SmolLM2 has no </think> token for a grammar to wait for: the grammar writes the whole output, no reasoning.
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert qwen3.adjust(constrained, opened) == constrained and qwen3.bind(opened, constrained) is None


def test_a_grammar_starts_after_the_reasoning(tokenizer):
    """As vLLM: with a reasoning parser, response_format or a forced tool call constrains the answer after
    </think>, not the reasoning; unless the prompt closed the block (thinking disabled)."""
    thinking = copy.deepcopy(tokenizer)
    thinking.add_tokens(["<think>", "</think>"])
    end = thinking.convert_tokens_to_ids("</think>")
    qwen3 = reasoning_parser("qwen3", thinking)
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    opened, closed = thinking.encode("assistant\n<think>\n"), thinking.encode("assistant\n<think>\n\n</think>\n\n")
    waiting = qwen3.adjust(constrained, opened)
    assert waiting.structured_outputs.starts_after_token == end
    assert waiting.structured_outputs.json == constrained.structured_outputs.json
    assert qwen3.bind(opened, waiting) == PromptReasoning(True)
    assert qwen3.adjust(constrained, closed) == constrained and qwen3.bind(closed, constrained) is None
    assert qwen3.adjust(SamplingParams(), opened) == SamplingParams()  # nothing to wait for
    # With no block in the prompt the grammar waits all the same: whatever comes before </think> is reasoning,
    # so the content is what the grammar wrote (a non-thinking model whose vocabulary has </think>)
    plain = thinking.encode("assistant\n")
    assert qwen3.bind(plain, qwen3.adjust(constrained, plain)).split('Hm.</think>{"a": 1}', True) == \
        ("Hm.", '{"a": 1}')
    assert qwen3.bind(plain, qwen3.adjust(constrained, plain)).split("no end marker", True) == ("no end marker", "")


def test_special_markers_are_kept_in_the_text(tokenizer):
    """Where a tokenizer marks <think> special, skipping special tokens would erase the markers the parser reads."""
    special = SimpleNamespace(all_special_tokens=["<|im_end|>", "<think>", "</think>"])
    special.encode, special.decode = (lambda text, add_special_tokens: [7]), (lambda ids: "</think>")
    assert reasoning_parser("qwen3", special).adjust(SamplingParams(), [1]).skip_special_tokens is False
    assert reasoning_parser("qwen3", tokenizer).adjust(SamplingParams(), [1]).skip_special_tokens is True
    with pytest.raises(ValueError, match="'step3' is not supported; supported: deepseek_r1, granite, openai_gptoss, qwen3"):
        reasoning_parser("step3", tokenizer)


def _client(tokenizer, script_text, **app_options):
    engine = AsyncEngine(FakeEngine(tokenizer, script_text=script_text, step_delay=0))
    return serve_in_thread(build_app(engine, **app_options))


def _chat(client, stream=False, **kwargs):
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Weather?"}],
                                          temperature=0, stream=stream, **{"max_tokens": 100, **kwargs})


@pytest.fixture(scope="module")
def qwen3_client(tokenizer):
    with _client(tokenizer, THINKING, reasoning_parser=reasoning_parser("qwen3", tokenizer)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_reasoning_and_content_whole_and_streamed(qwen3_client, tokenizer):
    n = len(tokenizer.encode(THINKING))
    message = _chat(qwen3_client, max_tokens=n).choices[0].message
    assert (message.reasoning, message.content) == (THOUGHT, "\n\nIt is sunny.")

    chunks = [c.choices[0] for c in _chat(qwen3_client, stream=True, max_tokens=n) if c.choices]
    assert chunks[0].delta.role == "assistant"
    assert "".join(getattr(c.delta, "reasoning", None) or "" for c in chunks) == THOUGHT
    assert "".join(c.delta.content or "" for c in chunks) == message.content  # no markup leaks into either
    assert all(c.delta.content or getattr(c.delta, "reasoning", None) or c.finish_reason or c.delta.role
               for c in chunks), "a chunk with nothing in it"


def test_include_reasoning_false_leaves_the_reasoning_out(qwen3_client, tokenizer):
    """vLLM's include_reasoning: the answer alone, whole and streamed; logprobs and token ids are not sent, as
    their tokens would spell the reasoning out."""
    n = len(tokenizer.encode(THINKING))
    body = {"include_reasoning": False, "return_token_ids": True}
    choice = _chat(qwen3_client, max_tokens=n, extra_body=body, logprobs=True, top_logprobs=1).choices[0]
    message = choice.message
    assert (getattr(message, "reasoning", None), message.content) == (None, "\n\nIt is sunny.")
    assert choice.logprobs is None and getattr(choice, "token_ids", None) is None
    chunks = [c.choices[0] for c in _chat(qwen3_client, stream=True, max_tokens=n, extra_body=body, logprobs=True)
              if c.choices]
    assert not any(getattr(c.delta, "reasoning", None) for c in chunks)
    assert "".join(c.delta.content or "" for c in chunks) == message.content
    assert all(c.logprobs is None and getattr(c, "token_ids", None) is None for c in chunks)
    assert all(c.delta.content or c.finish_reason or c.delta.role for c in chunks), "a chunk with nothing in it"


def test_an_answer_cut_short_while_thinking_is_all_reasoning(qwen3_client):
    choice = _chat(qwen3_client, max_tokens=6).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert THOUGHT.startswith(choice.message.reasoning) and choice.message.reasoning


def test_output_a_grammar_writes_whole_is_left_whole(qwen3_client):
    """Where </think> is no single token (SmolLM2's vocabulary), response_format's grammar writes the whole output:
    it is content, not split (the fake engine ignores the grammar and writes the script, markers included, which
    shows nothing was split off)."""
    choice = _chat(qwen3_client, max_tokens=4, response_format={"type": "json_object"}).choices[0]
    assert choice.message.content.startswith("<think>") and getattr(choice.message, "reasoning", None) is None


def test_without_a_parser_the_markup_is_content(tokenizer):
    with _client(tokenizer, THINKING) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        message = _chat(client, max_tokens=len(tokenizer.encode(THINKING))).choices[0].message
    assert message.content == THINKING and getattr(message, "reasoning", None) is None


def test_tool_calls_after_the_reasoning(tokenizer):
    """Qwen3 thinks, then calls: the hermes parser reads the calls out of the answer, not the reasoning."""
    with _client(tokenizer, f"<think>{THOUGHT}</think>{REPLY}", tool_parser=HermesToolParser(),
                 reasoning_parser=reasoning_parser("qwen3", tokenizer)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kwargs = dict(tools=TOOLS, stop=["</tool_call>"], extra_body={"include_stop_str_in_output": True})
        choice = _chat(client, **kwargs).choices[0]
        chunks = [c.choices[0] for c in _chat(client, stream=True, **kwargs) if c.choices]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning == THOUGHT
    assert choice.message.content == "Let me check. "
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert "".join(getattr(c.delta, "reasoning", None) or "" for c in chunks) == THOUGHT
    assert "".join(c.delta.content or "" for c in chunks) == "Let me check. "
    assert [t.function.name for c in chunks for t in c.delta.tool_calls or []] == ["get_weather"]


def test_a_template_that_opens_the_block_makes_the_output_reasoning(tokenizer):
    """DeepSeek-R1 distills and Qwen3-2507 Thinking: the template ends the prompt with <think>, and the model
    writes only </think>."""
    opening = copy.deepcopy(tokenizer)
    opening.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    script = f"{THOUGHT}</think>Sunny."
    with _client(opening, script, reasoning_parser=reasoning_parser("qwen3", opening)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        message = _chat(client, max_tokens=len(opening.encode(script))).choices[0].message
    assert (message.reasoning, message.content) == (THOUGHT, "Sunny.")


def test_serve_reasoning_parser_reaches_the_app(tokenizer, monkeypatch):
    """`jaxserve serve --reasoning-parser qwen3` hands the app the parser; an unknown name is an argparse error."""
    import socket

    from jaxserve.cli.main import build_parser
    from jaxserve.server import launch

    built = {}
    monkeypatch.setattr(launch, "build_app", lambda engine, **options: built.update(options, engine=engine))
    monkeypatch.setattr(launch, "DrainingServer", lambda *a, **k: SimpleNamespace(run=lambda sockets: None))
    args = build_parser()[0].parse_args(["serve", "--reasoning-parser", "qwen3"])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert launch.serve_engine(FakeEngine(tokenizer), args, sock) == 0
    built["engine"].shutdown()
    assert built["reasoning_parser"] == reasoning_parser("qwen3", tokenizer)
    with pytest.raises(SystemExit):
        build_parser()[0].parse_args(["serve", "--reasoning-parser", "step3"])


@pytest.mark.parametrize("script, reasoning, content", [
    ('</think>{"a": 1}', None, '{"a": 1}'),  # the model skipped <think>: the grammar's output alone is content
    ('Hm.</think>{"a": 1}', "Hm.", '{"a": 1}'),
    ("Hm, no end", "Hm, no end", None),  # never ended its reasoning: no content the grammar did not write
])
def test_the_content_is_what_the_grammar_wrote(tokenizer, script, reasoning, content):
    """response_format with the grammar waiting for </think>, the prompt opening no block: the text before the
    first </think> is reasoning, whether or not the model wrote <think> (it was content, so "</think>{...}" or
    free text came back as the JSON answer)."""
    thinking = copy.deepcopy(tokenizer)
    thinking.add_tokens(["<think>", "</think>"])
    with _client(thinking, script, reasoning_parser=reasoning_parser("qwen3", thinking)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kwargs = dict(max_tokens=len(thinking.encode(script)), response_format={"type": "json_object"})
        message = _chat(client, **kwargs).choices[0].message
        chunks = [c.choices[0] for c in _chat(client, stream=True, **kwargs) if c.choices]
    assert (getattr(message, "reasoning", None) or None, message.content) == (reasoning, content)
    assert "".join(c.delta.content or "" for c in chunks) == (content or "")
    assert "".join(getattr(c.delta, "reasoning", None) or "" for c in chunks) == (reasoning or "")


def test_a_forced_tool_call_after_the_reasoning_whole_and_streamed(tokenizer):
    """tool_choice naming a function: the model reasons first (the grammar waits for </think>), then writes the
    arguments, which become the call; the reasoning streams before them."""
    thinking = copy.deepcopy(tokenizer)
    thinking.add_tokens(["<think>", "</think>"])
    with _client(thinking, f'<think>{THOUGHT}</think>{{"city": "Paris"}} and more',
                 reasoning_parser=reasoning_parser("qwen3", thinking)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kwargs = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stop=["}"],
                      extra_body={"include_stop_str_in_output": True})
        message = _chat(client, **kwargs).choices[0].message
        chunks = [c.choices[0] for c in _chat(client, stream=True, **kwargs) if c.choices]
    assert message.reasoning == THOUGHT and message.content is None
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert "".join(getattr(c.delta, "reasoning", None) or "" for c in chunks) == THOUGHT
    calls = [t for c in chunks for t in c.delta.tool_calls or []]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(t.function.arguments for t in calls)) == {"city": "Paris"}
