"""Shared fixtures: the real SmolLM2 GGUF, one shared engine on it, and tiny random HF checkpoints."""

from __future__ import annotations

import os

import pytest

# Tests run on the host CPU; 8 fake devices let mesh tests run anywhere. Set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if os.environ.get("PALLAS_COMPILED") != "1":  # a GPU session's compiled kernel run (pallas_kernels/testing.py)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.helpers import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from jaxserve.loader.default_model import default_model_path

    return str(default_model_path())  # fetched once into the user cache, like the CLI does


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_gguf_path):
    """SmolLM2's tokenizer with its chat template, read from the GGUF once for every test that needs it: a
    byte-level BPE with <|im_start|>-style specials. Shared: tests must not change it."""
    from tests.server.helpers import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="session")
def smol_engine(smollm2_gguf_path):
    from jaxserve import Engine

    return Engine(smollm2_gguf_path, max_model_len=1024, num_kv_blocks=512, max_num_seqs=16,
                  max_num_batched_tokens=256, warmup=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' own reading of the same GGUF (its own dequantization): the reference model."""
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(smollm2_gguf_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer_source(request, tmp_path_factory) -> str:
    """Where tiny checkpoints take their tokenizer: a directory holding SmolLM2's, saved by transformers once per
    test process ($JAXSERVE_TEST_TOKENIZER_DIR: one given, as in a GPU session, where the GGUF cannot be fetched or
    carried). From a directory it loads in a fraction of a second; from the GGUF, transformers parses the whole
    file again for each checkpoint (about 12 s each)."""
    given = os.environ.get("JAXSERVE_TEST_TOKENIZER_DIR")
    if given:
        return given
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    request.getfixturevalue("smol_tokenizer").save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer_source):
    """Factory: tiny_checkpoint("llama", **config overrides) -> directory of a random-weight HF model."""
    cache = {}

    def make(arch: str, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_checkpoint(arch, out, tiny_tokenizer_source, **overrides)
        return cache[key]

    return make


@pytest.fixture
def fake_engine_module(monkeypatch, smol_tokenizer):
    """Stand `jaxserve.engine` in with the fake engine (the CLI tests), recording how it was built."""
    from tests.server.fake_engine import FakeEngine

    built = {}

    def make_engine(model, **kwargs):
        built.update(kwargs, model=model)
        return FakeEngine(smol_tokenizer)

    monkeypatch.setattr("jaxserve.engine.Engine", make_engine)
    return built
