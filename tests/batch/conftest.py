import pytest

from tests.server.helpers import load_default_tokenizer


@pytest.fixture(scope="session")
def smol_tokenizer_for_batch(smollm2_gguf_path):
    # smollm2_gguf_path fetches the default model or fails: never a silent skip.
    return load_default_tokenizer()


@pytest.fixture
def fake_engine(smol_tokenizer_for_batch):
    from types import SimpleNamespace

    from tests.server.fake_engine import FakeEngine

    engine = FakeEngine(smol_tokenizer_for_batch, step_delay=0)
    # The one thing the batch runner reads that the server's fake does not have.
    engine.config.scheduler = SimpleNamespace(max_num_seqs=4)
    return engine
