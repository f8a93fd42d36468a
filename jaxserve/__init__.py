"""jaxserve: a JAX/XLA inference engine for large language models."""

from jaxserve.xla_flags import set_default_xla_flags

set_default_xla_flags()  # before any jax backend starts: XLA reads its flags once (xla_flags.py says which, and why)

from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # The engines pull in jax; import them lazily so `import jaxserve` stays cheap for host-only code.
    if name == "Engine":
        from jaxserve.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from jaxserve.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)


__all__ = ["Engine", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest",
           "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput", "BeamSearchParams",
           "ScoringRequestOutput", "ScoringOutput", "ClassificationRequestOutput", "ClassificationOutput",
           "PoolingRequestOutput"]
