"""The tokenizer a model is served with (its own, or vLLM's `--tokenizer`), and chat templates through it
(transformers renders them in a sandboxed Jinja environment)."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from jaxserve.loader.chat_content import resolve_content_format, template_messages


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True, *,
                        continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                        tools: list[dict] | None = None, documents: list[dict] | None = None,
                        content_format: str = "auto", chat_template: str | None = None) -> list[int]:
    """Token ids of `messages` rendered by the chat template. `continue_final_message`: leave the last (assistant)
    message open for the model to go on with; `chat_template_kwargs`: extra template variables (e.g. Qwen3's
    `enable_thinking`); `tools`: OpenAI tool definitions, for templates that describe them to the model;
    `documents`: retrieved passages ({"title", "text"}), for templates that cite them (RAG);
    `content_format`: how message contents reach the template (loader/chat_content.py); `chat_template`: a
    template to render with instead of the tokenizer's (its Jinja text). The names are vLLM's."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template; use completions with a plain prompt, or start "
                         "the server with --chat-template")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: either a new "
                         "assistant turn starts or the last message goes on")
    reserved = sorted(set(chat_template_kwargs or {}) & _rendering_options(tokenizer))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: they are rendering options, not "
                         f"template variables")
    messages = template_messages(messages, template, resolve_content_format(content_format, template))
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            continue_final_message=continue_final_message, tools=tools,
                                            documents=documents, chat_template=chat_template,
                                            **(chat_template_kwargs or {}))
    except Exception as e:  # template errors come from Jinja with the template's own words
        raise ValueError(f"the chat template could not render these messages: {e}") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@dataclass(frozen=True)
class TokenizerChoice:
    """Which tokenizer a model is served with (vLLM's `tokenizer` and `tokenizer_revision`): its own (`given`
    None), a tokenizer object, or one loaded from a Hugging Face directory or hub id (e.g. a GGUF file's original
    model's, or the tokenizer of a weights-only repository), at `revision` on the hub."""

    given: Any = None
    revision: str | None = None
    download_dir: str | None = None  # where a hub tokenizer is downloaded to (None: the Hugging Face cache)

    def resolve(self, load_own: Callable[[], Any], vocab_size: int):
        """The tokenizer; `load_own` builds the checkpoint's, which is not even read when another is given. One
        naming more tokens than the model has embeddings is refused: those ids would index past its tables."""
        if self.given is None:
            if self.revision is not None:
                raise ValueError("tokenizer_revision applies to a tokenizer loaded from the hub, and the built-in "
                                 "model's comes from its GGUF file: leave tokenizer_revision out")
            return load_own()
        given = self.given
        loads = isinstance(given, (str, Path))
        tokenizer = load_tokenizer(given, self.revision, cache_dir=self.download_dir) if loads else given
        if len(tokenizer) > vocab_size:
            raise ValueError(f"tokenizer {given} has {len(tokenizer)} tokens and the model only {vocab_size}: it is "
                             "not this model's tokenizer; give the tokenizer the model was trained with")
        return tokenizer


def load_tokenizer(name: str | Path, revision: str | None = None,
                   advice: str = "give a directory with tokenizer files or a Hugging Face hub id",
                   cache_dir: str | None = None):
    """AutoTokenizer's tokenizer from a directory or hub id; a ValueError in one sentence, ending with `advice`,
    if it fails."""
    path = Path(name).expanduser()
    try:
        if revision is None and (tokenizer := load_plain_tokenizer(path)) is not None:
            return tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), revision=revision, cache_dir=cache_dir)
    except (OSError, ValueError) as exc:  # no such directory or hub id, no network, no tokenizer files in it
        raise ValueError(f"cannot load tokenizer {str(name)!r} ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0].strip()}); {advice}") from None


# tokenizer_config.json classes that are tokenizer.json and nothing of a model's own (transformers 5's
# TokenizersBackend; PreTrainedTokenizerFast is its older name, which Llama 3's repositories give).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# config.json model types for which AutoTokenizer loads a generic class as it is named. transformers replaces the
# named class for some model types (Phi-3's and Qwen2's among them, in transformers 5.24: classes their hub
# repositories are known to name wrongly), so a model type is listed only once
# tests/loader/test_tokenizer_fast_path.py shows AutoTokenizer's tokenizer and ours to be the same for it.
PLAIN_TOKENIZER_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3",
    "gemma3_text", "granite", "smollm3", "gpt_oss"})


def load_plain_tokenizer(directory: Path):
    """The tokenizer of a local directory whose tokenizer is its tokenizer.json alone (a generic class, no code of
    its own, and no model type or one AutoTokenizer takes at its word), loaded without AutoTokenizer; None for any
    other. AutoTokenizer reads the model's config through transformers' config classes, which import torch where
    it is installed: ~4 s and ~250 MB more for each process that starts (a tiny Llama's engine built in 10.5 s and
    504 MB, 4.9 s and 239 MB without), for a tokenizer that needs none of it."""
    try:
        settings = json.loads((directory / "tokenizer_config.json").read_text())
        config = directory / "config.json"  # without one (a tokenizer alone), AutoTokenizer has no type to go by
        model_config = json.loads(config.read_text()) if config.exists() else {}
    except (OSError, ValueError):
        return None  # not a local directory, or one AutoTokenizer has to make sense of
    if not (isinstance(settings, dict) and isinstance(model_config, dict)):
        return None
    model_type = model_config.get("model_type")
    plain = (settings.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and "auto_map" not in settings
             and (model_type is None or model_type in PLAIN_TOKENIZER_MODEL_TYPES)
             and (directory / "tokenizer.json").is_file()
             and not (directory / "tekken.json").exists())  # Mistral's own format: AutoTokenizer's to choose
    if not plain:
        return None
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory))


def _rendering_options(tokenizer) -> set[str]:
    """apply_chat_template's own keyword arguments: a request's chat_template_kwargs must not smuggle these in."""
    return set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"} | {"messages"}


def is_template_text(value: str) -> bool:
    """A `chat_template` value holding Jinja's markers is the template itself; anything else names a file."""
    return "{" in value


def read_chat_template(value: str) -> str:
    """`chat_template=`: a file holding a Jinja chat template, or the template itself (as vLLM takes it). It is
    compiled now, as transformers compiles it to render chats, so a broken template fails at start-up rather
    than on every chat request."""
    if is_template_text(value):
        template, source = value, "given"
    else:
        path = Path(value).expanduser()
        try:
            template, source = path.read_text(), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat template {value!r} is neither a readable file ({getattr(exc, 'strerror', exc)}) "
                             f"nor a Jinja template; give the path of a template file or the template text") from None
    try:
        _compile(template)
    except Exception as exc:  # jinja2.TemplateSyntaxError and its kin: one sentence with the line
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise ValueError(f"chat template {source} is not valid Jinja: {getattr(exc, 'message', exc)}{where}") from None
    return template


def _compile(template: str) -> None:
    try:  # transformers' own compile (its sandbox and extensions: loop controls, {% generation %})
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: plain Jinja with loop controls
        import jinja2

        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        return
    _compile_jinja_template(template)
