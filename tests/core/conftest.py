import os

import pytest


@pytest.fixture(scope="module")
def smol_tokenizer(request):
    """SmolLM2's tokenizer, read from the GGUF file (a byte-level BPE with <|im_start|>-style specials)."""
    from transformers import AutoTokenizer

    path = request.getfixturevalue("smollm2_gguf_path")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
