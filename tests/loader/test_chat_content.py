"""--chat-template-content-format: message contents reach the template as one string or as text parts, and
"auto" reads which from the template."""

import copy

import pytest

from jaxserve import SamplingParams
from jaxserve.cli import main as cli
from jaxserve.engine import Engine
from jaxserve.loader.chat_content import resolve_content_format, template_messages
from jaxserve.loader.tokenizer import apply_chat_template

# A template that loops over content parts, as Llama 4's and vision models' do.
PARTS_TEMPLATE = ("{% for message in messages %}<{{ message['role'] }}>{% for part in message['content'] %}"
                  "{{ part['text'] }}{% endfor %}</{{ message['role'] }}>{% endfor %}")
STRING_TEMPLATE = "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}{% endfor %}"


@pytest.mark.parametrize("template, want", [
    (PARTS_TEMPLATE, "openai"),
    ("{%- for m in messages %}{%- for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    ('{% for item in message["content"] %}{{ item["text"] }}{% endfor %}', "openai"),
    (STRING_TEMPLATE, "string"),
    ("{% for message in messages %}{% for tool_call in message.tool_calls %}{% endfor %}{% endfor %}", "string"),
    ("{%+ for part in message.content | selectattr('type', 'equalto', 'text') %}{% endfor %}", "openai"),
    ("{% for line in message.content.split('\\n') %}{{ line }}{% endfor %}", "string"),  # loops over its lines
    ({"default": PARTS_TEMPLATE, "tool_use": STRING_TEMPLATE}, "openai"),
    ({"default": STRING_TEMPLATE, "tool_use": PARTS_TEMPLATE}, "string"),  # "default" renders plain chats
    (None, "string"),
])
def test_auto_reads_the_template(template, want):
    assert resolve_content_format("auto", template) == want
    assert resolve_content_format("string", PARTS_TEMPLATE) == "string"  # what is given wins


def test_an_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="chat_template_content_format='parts' is not one of auto, string, openai"):
        resolve_content_format("parts", STRING_TEMPLATE)


def test_contents_are_shaped_both_ways():
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "input_text", "text": "you"}]},
                {"role": "assistant", "content": "Hello", "name": "bot"}, {"role": "assistant", "content": ""},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                {"role": "tool", "content": [{"type": "text", "text": "18C"}], "tool_call_id": "c"}]
    assert template_messages(messages, STRING_TEMPLATE, "string") == [
        {"role": "user", "content": "Hi \nyou"},  # joined as vLLM joins
        {"role": "assistant", "content": "Hello", "name": "bot"}, {"role": "assistant", "content": ""},
        {"role": "assistant", "content": ""},  # an empty tool_calls is dropped, as vLLM drops it
        {"role": "assistant", "content": "No."}, {"role": "tool", "content": "18C", "tool_call_id": "c"}]
    assert template_messages(messages, STRING_TEMPLATE, "openai") == [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}], "name": "bot"},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]}, {"role": "assistant", "content": []},
        {"role": "assistant", "content": [{"type": "text", "text": "No."}]},
        {"role": "tool", "content": "18C", "tool_call_id": "c"}]  # a tool's result is one string either way
    assert messages[3]["tool_calls"] == []  # the caller's messages are left as they were


def test_developer_messages_are_system_messages_for_templates_without_the_role():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "developer", "content": "Answer in French."}]
    assert template_messages(messages, STRING_TEMPLATE, "string") == [
        {"role": "system", "content": "Be brief.\n\nAnswer in French."}, {"role": "user", "content": "hi"}]
    knows = STRING_TEMPLATE + "{% if message['role'] == 'developer' %}{% endif %}"
    assert template_messages(messages, knows, "string") == messages


def test_tool_call_arguments_reach_the_template_as_objects():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}
    broken = [{**call, "function": {"name": "f", "arguments": value}} for value in ("", "not json", "[1, 2]", None)]
    messages = [{"role": "assistant", "tool_calls": [call, *broken]}]  # OpenAI's shape: no content key
    shaped = template_messages(messages, STRING_TEMPLATE, "string")[0]
    assert [c["function"]["arguments"] for c in shaped["tool_calls"]] == [{"city": "Oslo"}, {}, {}, {}, {}]
    assert shaped["content"] == "" and call["function"]["arguments"] == '{"city": "Oslo"}'


def test_a_parts_template_renders_plain_string_messages(smol_tokenizer):
    """The template that loops over parts gets parts under "auto", so a plain string message keeps its words;
    given as a string instead, the loop would walk its characters and print nothing."""
    tokenizer = copy.deepcopy(smol_tokenizer)  # the shared one must not change
    tokenizer.chat_template = PARTS_TEMPLATE
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer.decode(apply_chat_template(tokenizer, messages, add_generation_prompt=False))
    assert rendered == "<user>What is the capital of France?</user>"
    as_string = tokenizer.decode(apply_chat_template(tokenizer, messages, add_generation_prompt=False,
                                                     content_format="string"))
    assert as_string == "<user></user>"


def test_the_engine_renders_in_the_format_it_was_given(tiny_checkpoint):
    engine = Engine(str(tiny_checkpoint("llama")), num_kv_blocks=16, warmup=False, chat_template=PARTS_TEMPLATE)
    assert engine.chat_content_format == "openai"
    ids = engine.encode_chat([{"role": "user", "content": "Name a fruit."}], add_generation_prompt=False)
    assert engine.tokenizer.decode(ids) == "<user>Name a fruit.</user>"
    # vLLM's LLM.chat options: another template for these messages, another content format
    greeting = [{"role": "user", "content": "Hi"}]
    own = engine.chat(greeting, SamplingParams(max_tokens=1), use_tqdm=False,
                      chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")[0]
    assert engine.tokenizer.decode(own.prompt_token_ids) == "[Hi]"
    as_string = engine.chat(greeting, SamplingParams(max_tokens=1), use_tqdm=False,
                            chat_template_content_format="string")[0]
    assert engine.tokenizer.decode(as_string.prompt_token_ids) == "<user></user>"  # the parts template saw a string
    # An image part is refused, not dropped (the model would answer a question it never saw), as the server does
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(ValueError, match="only text content parts .* not 'image_url'"):
        engine.chat([{"role": "user", "content": image}], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        Engine(str(tiny_checkpoint("llama")), chat_template_content_format="parts")


def test_the_cli_option_reaches_the_engine(fake_engine_module):
    assert cli.main(["generate", "--prompt", "x", "--chat-template-content-format", "string", "org/model"]) == 0
    assert fake_engine_module["chat_template_content_format"] == "string"


def test_offline_chat_renders_tool_calls_as_the_server_does(smol_tokenizer):
    """Engine.chat (vLLM's LLM.chat) goes through the same preparation: a call's JSON text reaches a template
    that writes it with tojson once, not double-encoded, and an assistant turn without a content key renders."""
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% for c in m.tool_calls or [] %}"
                               "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]}]
    rendered = tokenizer.decode(apply_chat_template(tokenizer, messages, add_generation_prompt=False))
    assert rendered == '<user>Weather?<assistant>{"city": "Oslo"}'
