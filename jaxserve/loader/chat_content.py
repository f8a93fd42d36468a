"""How OpenAI chat messages reach the chat template, as vLLM prepares them (`template_messages`).

Content (vLLM's `--chat-template-content-format`): "string" is one string, text parts joined by newlines as vLLM
joins them (what most templates expect); "openai" a list of parts, [{"type": "text", "text": ...}], for templates
that loop over them (Llama 4's, Mistral Small 3.1's, vision models'). "auto" reads the template: a `for` loop
over a message's content means "openai". Only text-like parts are taken (text, input_text, output_text, refusal,
thinking: the models served read no images or audio), so the two formats carry the same words; a tool's result is
one string either way. Messages: a `developer` message is a system message for templates that do not name the
role (system messages then merged into one, first); an assistant turn's empty `tool_calls` is dropped, and each
call's arguments reach the template as an object (templates write them with `tojson`), {} for anything else.
"""

from __future__ import annotations

import json
import logging
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


log = logging.getLogger(__name__)

# Content part types that are text, and the key holding it (OpenAI's and vLLM's text-like parts)
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}


def check_text_parts(content) -> None:
    """A ValueError unless every part of a list content is a text-like part: an image or audio part dropped would
    leave the model answering a question it never saw."""
    if not isinstance(content, list):
        return
    for part in content:
        key = TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
        if key is None or not isinstance(part.get(key), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, not "
                             f"{kind!r}: the models jaxserve serves read no images or audio")


def template_messages(messages: list[dict], template, content_format: str) -> list[dict]:
    """The messages as the chat `template` gets them (module docstring), content in `content_format` ("string" or
    "openai"); other keys are kept and the given messages are left unchanged. A ValueError names what is wrong."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"each message needs a 'role' (and its 'content'); got {m!r}")
        check_text_parts(m.get("content"))
    messages = [_with_object_arguments(m) for m in messages]
    if any(m["role"] == "developer" for m in messages) and not _names_developer(template):
        messages = _system_first([{**m, "role": "system"} if m["role"] == "developer" else m for m in messages])
    return [{**m, "content": _shaped(m.get("content"), "string" if m["role"] == "tool" else content_format)}
            for m in messages]


def _names_developer(template) -> bool:
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and ('"developer"' in t or "'developer'" in t) for t in texts)


def _system_first(messages: list[dict]) -> list[dict]:
    """System messages merged into one at the start (templates that take one system message, first)."""
    systems = [m for m in messages if m["role"] == "system"]
    if len(systems) <= 1 and messages[0]["role"] == "system":
        return messages
    text = "\n\n".join(t for t in (_shaped(m.get("content"), "string") for m in systems) if t)
    return [{"role": "system", "content": text}, *(m for m in messages if m["role"] != "system")]


def _with_object_arguments(message: dict) -> dict:
    """An assistant turn's tool calls as templates read them: none when the list is empty, each call's
    arguments an object ({} when they are no JSON object: a history's broken call must not stop the chat)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    if not calls:
        return {key: value for key, value in message.items() if key != "tool_calls"}
    fixed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and not isinstance(function.get("arguments"), dict):
            arguments = _json_object(function.get("arguments"))
            call = {**call, "function": {**function, "arguments": arguments}}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def _json_object(arguments) -> dict:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) and arguments else None
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        if arguments not in (None, ""):
            log.warning("a tool call's arguments in the messages are no JSON object; the template gets {}")
        return {}
    return value


def _shaped(content, content_format: str):
    """None (an assistant turn of tool calls alone) is "" or no parts; any string, "" too, is one text part."""
    if content_format == "string":
        if isinstance(content, list):
            return "\n".join(part[TEXT_PARTS[part["type"]]] for part in content)
        return "" if content is None else content
    if isinstance(content, list):
        return [{"type": "text", "text": part[TEXT_PARTS[part["type"]]]} for part in content]
    return [] if content is None else [{"type": "text", "text": content}]
