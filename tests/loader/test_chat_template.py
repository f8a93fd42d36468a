"""`chat_template=` / `--chat-template`: a file or the Jinja text replaces the tokenizer's template; a broken or
missing one fails when the engine starts, before the weights load."""

import pytest

from jaxserve.loader.tokenizer import read_chat_template

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}" \
           "<assistant>{% endif %}{% if enable_thinking %}<think>{% endif %}"


def test_a_file_or_the_template_text(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    long_inline = TEMPLATE + "x" * 300  # longer than a file name may be: still the template itself
    assert read_chat_template(long_inline) == long_inline


def test_templates_using_transformers_extensions_are_accepted():
    """Hub templates use Jinja's loop controls and transformers' {% generation %} tag; they render, so they pass."""
    loop_controls = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
    generation = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    for template in (loop_controls, generation):
        assert read_chat_template(template) == template


@pytest.mark.parametrize("value, expected", [
    ("templates/missing.jinja", "neither a readable file"),
    ("{% for m in messages %}{{ m }}", "not valid Jinja"),  # no endfor
])
def test_bad_templates_are_refused_with_the_reason(value, expected):
    with pytest.raises(ValueError, match=expected):
        read_chat_template(value)


def test_the_engine_renders_chats_with_the_given_template(tiny_checkpoint, tmp_path):
    from jaxserve import Engine, SamplingParams

    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    engine = Engine(str(tiny_checkpoint("llama")), chat_template=str(path), num_kv_blocks=16, max_num_seqs=2,
                    max_num_batched_tokens=16, warmup=False)
    ids = engine.encode_chat([{"role": "user", "content": "Hi there"}])
    assert engine.tokenizer.decode(ids) == "<user>Hi there<assistant>"
    out = engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                      chat_template_kwargs={"enable_thinking": True})[0]  # as vLLM's LLM.chat takes them
    assert engine.tokenizer.decode(out.prompt_token_ids) == "<user>Hi<assistant><think>"


def test_a_broken_template_fails_before_the_model_loads(monkeypatch):
    from jaxserve.engine import engine as engine_module

    def must_not_load(*args):
        raise AssertionError("the checkpoint was opened before the template was checked")

    monkeypatch.setattr(engine_module, "open_checkpoint", must_not_load)
    with pytest.raises(ValueError, match="not valid Jinja"):
        engine_module.Engine("/no/such/model", chat_template="{{ unclosed")


def test_template_variables_and_an_open_last_message(tiny_checkpoint):
    from transformers import AutoTokenizer

    from jaxserve.loader.tokenizer import apply_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
                               "{% if enable_thinking %}<think>{% endif %}")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]

    def render(**kw):
        return tokenizer.decode(apply_chat_template(tokenizer, messages, False, **kw))

    assert render() == "<user>Hi</><assistant>Hello</>"
    assert render(chat_template_kwargs={"enable_thinking": True}) == "<user>Hi</><assistant>Hello</><think>"
    # transformers cuts the rendering right after the last message's content.
    assert render(continue_final_message=True).endswith("<assistant>Hello")
