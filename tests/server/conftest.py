import pytest

from tests.server.helpers import REAL_SERVER_ARGS, server_process


@pytest.fixture(scope="session")
def tokenizer(smol_tokenizer):
    return smol_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tokenizer, tmp_path_factory):
    """The default model's tokenizer saved as tokenizer.json: it loads in a fraction of the time the GGUF takes
    (fake_serve.py's server processes read it)."""
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def real_server(tmp_path_factory, tokenizer):
    """One real server for every module that tests it: starting it (loading, first compiles) is the slow part."""
    with server_process(REAL_SERVER_ARGS, tmp_path_factory.mktemp("server") / "serve.log") as server:
        yield server


@pytest.fixture
def openai_client(real_server):
    import openai

    from tests.server.helpers import API_KEY

    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
