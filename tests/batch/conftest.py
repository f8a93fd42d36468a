import pytest


@pytest.fixture
def fake_engine(smol_tokenizer):
    from types import SimpleNamespace

    from tests.server.fake_engine import FakeEngine

    engine = FakeEngine(smol_tokenizer, step_delay=0)
    # The one thing the batch runner reads that the server's fake does not have.
    engine.config.scheduler = SimpleNamespace(max_num_seqs=4)
    return engine
