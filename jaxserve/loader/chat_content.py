"""How a message's content reaches the chat template (vLLM's `--chat-template-content-format`).

"string": one string, text parts joined by newlines as vLLM joins them (what most templates expect). "openai": a
list of parts,
[{"type": "text", "text": ...}], for templates that loop over them (Llama 4's, Mistral Small 3.1's, vision
models'). "auto" reads the template: a `for` loop over a message's content means "openai". Only text parts are
taken (the models served read no images or audio), so the two formats carry the same words.
"""

from __future__ import annotations

import re

from jaxserve.engine_args import CONTENT_FORMATS  # declared with the option

# `{% for part in message['content'] %}`, `message["content"]`, `message.content`, maybe through a filter, whatever
# the loop variables are called: a template that iterates a message's content expects parts. (A loop over
# something made of the content, `message.content.split(...)`, is not one.)
_LOOP_OVER_CONTENT = re.compile(r"\{%[-+]?\s*for\s+\w+\s+in\s+\w+\s*(?:\[\s*['\"]content['\"]\s*\]|\.content)"
                                r"\s*(?:[-+]?%\}|\||if\b)")


def check_content_format(content_format: str) -> None:
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format={content_format!r} is not one of {', '.join(CONTENT_FORMATS)}")


def resolve_content_format(content_format: str, template: str | None) -> str:
    """"string" or "openai": the given format, or for "auto" the one `template` reads."""
    check_content_format(content_format)
    if content_format != "auto":
        return content_format
    if isinstance(template, dict):  # a tokenizer's named templates: "default" renders chats without tools
        template = template.get("default")
    return "openai" if isinstance(template, str) and _LOOP_OVER_CONTENT.search(template) else "string"


def check_text_parts(content) -> None:
    """A ValueError unless every part of a list content is a text part: an image or audio part dropped would
    leave the model answering a question it never saw."""
    if not isinstance(content, list):
        return
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, not "
                             f"{kind!r}: the models jaxserve serves read no images or audio")


def shape_content(messages: list[dict], content_format: str) -> list[dict]:
    """The messages with each content in `content_format` ("string" or "openai"); other keys are kept. A ValueError
    names a part that is not text."""
    for message in messages:
        check_text_parts(message.get("content"))
    return [{**m, "content": _shaped(m.get("content"), content_format)} for m in messages]


def _shaped(content, content_format: str):
    """None (an assistant turn of tool calls alone) is "" or no parts; any string, "" too, is one text part."""
    if content_format == "string":
        if isinstance(content, list):
            return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
        return "" if content is None else content
    if isinstance(content, list):
        return content
    return [] if content is None else [{"type": "text", "text": content}]
