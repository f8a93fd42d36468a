"""A local tokenizer that is its tokenizer.json alone loads without AutoTokenizer (loader/tokenizer.py), and is
then the very tokenizer AutoTokenizer gives: same class, same ids, same text back, same specials, same chat."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.loader.tokenizer import (
    GENERIC_TOKENIZER_CLASSES,
    PLAIN_TOKENIZER_MODEL_TYPES,
    load_plain_tokenizer,
    load_tokenizer,
)

TEXTS = ["Hello, world!", "  two spaces, a tab\tand a newline\n", "<|im_start|>user\nhi<|im_end|>", "naïve café 東京 🙂",
         "<|endoftext|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def tokenizer_dir(tmp_path: Path, source: str, model_type: str | None, tokenizer_class: str = "TokenizersBackend",
                  **extra) -> Path:
    """The tiny checkpoints' tokenizer beside a config.json of `model_type` (None: no config.json)."""
    directory = tmp_path / f"{model_type}-{tokenizer_class}"
    shutil.copytree(source, directory)
    settings_path = directory / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text()) | {"tokenizer_class": tokenizer_class} | extra
    settings_path.write_text(json.dumps(settings))
    (directory / "config.json").unlink(missing_ok=True)
    if model_type is not None:
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return directory


@pytest.mark.parametrize("tokenizer_class", GENERIC_TOKENIZER_CLASSES)
@pytest.mark.parametrize("model_type", sorted(PLAIN_TOKENIZER_MODEL_TYPES) + [None])  # None: no config.json
def test_the_plain_tokenizer_is_auto_tokenizers(tmp_path, tiny_tokenizer_source, model_type, tokenizer_class):
    from transformers import AutoTokenizer

    directory = tokenizer_dir(tmp_path, tiny_tokenizer_source, model_type, tokenizer_class)
    assert load_plain_tokenizer(directory) is not None  # the path without AutoTokenizer is the one taken
    ours, auto = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    assert type(ours) is type(auto), f"AutoTokenizer gives {model_type} a {type(auto).__name__}: drop it from the list"
    assert len(ours) == len(auto) and ours.all_special_tokens == auto.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                         auto.pad_token_id)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == auto(text)["input_ids"], text
        assert ours.decode(ids) == auto.decode(ids) and ours.decode(ids, skip_special_tokens=True) == auto.decode(
            ids, skip_special_tokens=True)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=True) == auto.apply_chat_template(
        CHAT, add_generation_prompt=True)


@pytest.mark.parametrize("case", ["phi3", "qwen2", "own class", "remote code", "mistral format", "no tokenizer.json",
                                  "config.json not an object"])
def test_any_other_tokenizer_is_left_to_auto_tokenizer(tmp_path, tiny_tokenizer_source, case):
    """Phi-3, Qwen2: transformers replaces the generic class their hub repositories name. The rest: a class, code or format of the
    model's own, a tokenizer.json missing, or a config.json to make sense of."""
    model_type = {"phi3": "phi3", "qwen2": "qwen2"}.get(case, "llama")
    tokenizer_class = "LlamaTokenizer" if case == "own class" else "TokenizersBackend"
    extra = {"auto_map": {"AutoTokenizer": [None, "tokenization.Custom"]}} if case == "remote code" else {}
    directory = tokenizer_dir(tmp_path, tiny_tokenizer_source, model_type, tokenizer_class, **extra)
    if case == "mistral format":
        (directory / "tekken.json").write_text("{}")
    if case == "no tokenizer.json":
        (directory / "tokenizer.json").unlink()
    if case == "config.json not an object":
        (directory / "config.json").write_text("[]")
    assert load_plain_tokenizer(directory) is None
    assert load_plain_tokenizer(directory.parent / "no-such-directory") is None


def test_a_process_loading_a_plain_tokenizer_imports_no_torch(tmp_path, tiny_tokenizer_source):
    directory = tokenizer_dir(tmp_path, tiny_tokenizer_source, "llama")
    code = ("import sys; from jaxserve.loader.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(directory)!r}); print(len(t), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1024", "False"]
