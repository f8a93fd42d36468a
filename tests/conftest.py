"""Shared fixtures: the real SmolLM2 GGUF, one shared engine on it, and tiny random HF checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import FAKE_DEVICES_XLA_FLAGS, FAST_COMPILE_XLA_FLAGS, make_tiny_checkpoint, truncate_bpe_tokenizer

# Tests run on the host CPU. Set before jax is imported (tests.helpers does not import it), and inherited by the
# servers and jobs the tests start.
if os.environ.get("PALLAS_COMPILED") == "1":  # a GPU session's compiled kernel run (pallas_kernels/testing.py)
    os.environ.setdefault("XLA_FLAGS", FAKE_DEVICES_XLA_FLAGS)
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", f"{FAKE_DEVICES_XLA_FLAGS} {FAST_COMPILE_XLA_FLAGS}")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Two xdist workers share two cores: the torch references (transformers) spinning a thread on each core beside
    the other worker's XLA ran SmolLM2's greedy reference 3x slower than one thread does (its ops are small)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from jaxserve.loader.default_model import default_model_path

    return str(default_model_path())  # fetched once into the user cache, like the CLI does


@pytest.fixture(scope="session")
def gguf_tokenizer_source() -> str:
    """The same file as `smollm2_gguf_path`, for what reads only its tokenizer (`smol_tokenizer`, and the metadata
    `tests.helpers.write_gguf` copies into a tiny model's GGUF): under this name a test stays a tiny-model one and
    compiles unoptimised (the root conftest.py's REAL_MODEL_FIXTURES), not as for SmolLM2's 30 layers. Measured on
    the GGUF parity, kept-blocks and loading tests: 289 -> 197 s of CPU."""
    from jaxserve.loader.default_model import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def smol_tokenizer(gguf_tokenizer_source):
    """SmolLM2's tokenizer with its chat template, read from the GGUF once for every test that needs it: a
    byte-level BPE with <|im_start|>-style specials. Shared: tests must not change it. A test that takes it and no
    real-model fixture runs a tiny or fake engine, so it compiles unoptimised."""
    from tests.server.helpers import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="session")
def smol_engine(smollm2_gguf_path):
    from jaxserve import Engine

    return Engine(smollm2_gguf_path, max_model_len=1024, num_kv_blocks=512, max_num_seqs=16,
                  max_num_batched_tokens=256, warmup=False)


@pytest.fixture(scope="session")
def run_tmp(tmp_path_factory) -> Path:
    """A directory this test run's processes share: under xdist, the parent of the workers' temp dirs (one per run);
    alone, the process's own. Guard what goes in it with a FileLock."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path, run_tmp):
    """transformers' own reading of the same GGUF (its own dequantization): the reference model.
    transformers parses and dequantizes the whole GGUF in about 10 s, so the first process to need it saves what it
    read as safetensors for the run's other workers, which load that in a second: one reading, by transformers."""
    import functools
    from unittest import mock

    import gguf
    import torch
    from filelock import FileLock
    from transformers import AutoModelForCausalLM

    saved = run_tmp / "smollm2-transformers-float32"
    with FileLock(f"{saved}.lock"):
        if not saved.exists():
            d, f = os.path.split(smollm2_gguf_path)
            partial = run_tmp / "smollm2-transformers-float32.partial"
            # transformers asks gguf for the same tensor name map once per module (397 times, 15 ms each); the same
            # answer each time, remembered: 14.6 s -> 9.3 s, the same weights.
            with mock.patch("gguf.get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
                model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
            model.hf_quantizer = None  # it holds float32 tensors now; transformers refuses to save a "GGUF model"
            del model.config.quantization_config
            model.save_pretrained(partial)
            partial.rename(saved)  # whole or absent, should a process die mid-write
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer_source(request, tmp_path_factory) -> str:
    """Where tiny checkpoints take their tokenizer: a directory holding SmolLM2's, written once per test process
    (a copy of $JAXSERVE_TEST_TOKENIZER_DIR where one is given, as in a GPU session, where the GGUF cannot be
    fetched or carried) and cut to its first TINY_VOCAB ids (tests/helpers.truncate_bpe_tokenizer)."""
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    given = os.environ.get("JAXSERVE_TEST_TOKENIZER_DIR")
    if given:
        shutil.copytree(given, directory, dirs_exist_ok=True)
    else:
        request.getfixturevalue("smol_tokenizer").save_pretrained(directory)
    truncate_bpe_tokenizer(directory)
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


# Session fixtures too costly to build once per xdist worker: every test using one runs on the same worker
# (`--dist loadgroup`, pyproject's addopts), so the run builds each once. The real server's start-up (loading, the
# warm-up compiles) is the largest; the shared engine's tests run together there too, so that the worker switches
# XLA's optimisations (../conftest.py) around them once, not at every file (a switch drops its programs).
ONE_WORKER_FIXTURES = ("real_server", "smol_engine")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if any(name in ONE_WORKER_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("real_model"))
