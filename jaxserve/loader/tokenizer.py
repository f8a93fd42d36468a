"""Chat templates through the tokenizer (transformers renders them in a sandboxed Jinja environment)."""

from __future__ import annotations

from pathlib import Path


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use completions with a plain prompt, or start "
                         "the server with --chat-template")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content'; got {m!r}")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as e:  # template errors come from Jinja with the template's own words
        raise ValueError(f"the chat template could not render these messages: {e}") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def read_chat_template(value: str) -> str:
    """`chat_template=`: a file holding a Jinja chat template, or the template itself (as vLLM takes it); its
    syntax is checked now, so a broken template fails at start-up rather than on every chat request."""
    import jinja2

    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text()
    elif "{" in value:  # Jinja's markers: the template itself, not a path
        template = value
    else:
        raise ValueError(f"chat template {value!r} is neither an existing file nor a Jinja template; give the path "
                         f"of a template file or the template text")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {value if path.is_file() else 'given'} is not valid Jinja: {exc.message} "
                         f"(line {exc.lineno})") from None
    return template
