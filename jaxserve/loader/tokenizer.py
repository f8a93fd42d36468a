"""Chat templates through the tokenizer (transformers renders them in a sandboxed Jinja environment)."""

from __future__ import annotations


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use completions with a plain prompt instead")
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
