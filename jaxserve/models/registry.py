"""Maps Hugging Face `architectures` names to model modules."""

from __future__ import annotations

from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.gemma import GemmaForCausalLM
from jaxserve.models.granite import GraniteForCausalLM
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.mixtral import MixtralForCausalLM

ARCHITECTURES: dict[str, type] = {
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,  # text-only Gemma 3 (1B)
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # Phi-3 and Phi-4: fused projections split at load (loader/fused.py)
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,  # Llama with NoPE layers (no RoPE on every 4th)
    "Qwen2MoeForCausalLM": MixtralForCausalLM,  # Qwen2's attention (q/k/v biases), routed and shared experts
    "GptOssForCausalLM": MixtralForCausalLM,  # attention sinks and biases; biased experts, clamped SwiGLU
    "Qwen3MoeForCausalLM": MixtralForCausalLM,  # Qwen3's attention (q/k norms) with Mixtral's kind of MLP
}


def model_class(architecture: str) -> type:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"architecture {architecture!r} is not supported; supported architectures: {supported}") from None


def abstract_model(cfg: ModelConfig, dtype, quantization: str | None = None):
    """(graphdef, abstract state): shapes, dtypes and logical axis names, no memory."""
    cls = model_class(cfg.architecture)
    return nnx.split(nnx.eval_shape(lambda: cls(cfg, dtype, quantization)))
