"""Frozen configuration objects, passed explicitly (no globals, no environment switches).

Variants are made with `dataclasses.replace`. `ModelConfig` describes an architecture (read from an HF
`config.json` or GGUF metadata); the others describe how the engine runs it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

ROUTER_SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MeshShape:
    """A device mesh: `tp` tensor-parallel devices x `pp` pipeline stages. Parsed once, where the user gave it
    (`--mesh 8x2`, `mesh="8x2"`, `-tp 8 -pp 2`, a job file's keys), and passed on as this value; it unpacks as
    `tp, pp = shape`."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh '{self.tp}x{self.pp}' needs tp >= 1 and pp >= 1")

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """"8x2" -> MeshShape(tp=8, pp=2)."""
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(text))
        if not m:
            raise ValueError(f"mesh {text!r} is not of the form TPxPP, e.g. 8x2 for 8 tensor-parallel devices x "
                             "2 pipeline stages")
        return cls(int(m.group(1)), int(m.group(2)))

    @classmethod
    def of(cls, mesh: MeshShape | str | tuple[int, int] | None = None, tensor_parallel_size: int | None = None,
           pipeline_parallel_size: int | None = None) -> MeshShape:
        """The mesh from either of its two spellings, vLLM's sizes (either may be left out: 1) or TPxPP; not both."""
        sizes = (tensor_parallel_size, pipeline_parallel_size)
        if mesh is not None and sizes != (None, None):
            raise ValueError("give the mesh either as mesh TPxPP (--mesh) or as tensor_parallel_size/"
                             "pipeline_parallel_size (-tp/-pp), not both")
        if isinstance(mesh, MeshShape):
            return mesh
        if isinstance(mesh, tuple):
            return cls(*mesh)
        if mesh is not None:
            return cls.parse(mesh)
        for name, n in zip(("tensor_parallel_size", "pipeline_parallel_size"), sizes):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        return cls(tensor_parallel_size or 1, pipeline_parallel_size or 1)

    @property
    def size(self) -> int:
        return self.tp * self.pp

    def __iter__(self):
        return iter((self.tp, self.pp))

    def __str__(self) -> str:
        return f"{self.tp}x{self.pp}"


# Engine(attention_impl=...): "auto" takes the Pallas kernels on GPU/TPU and the reference on CPU.
ATTENTION_IMPLS = ("auto", "reference", "pallas", "pallas-interpret")
# Engine(layer_loop=...): "auto" unrolls the layers over per-layer weights on GPU, scans stacked ones elsewhere.
LAYER_LOOPS = ("auto", "scan", "unrolled")
# Engine(quantization=...) values that keep a quantized checkpoint's weights in their blocks, each named after the
# checkpoints it reads (runner/weights.py).
BLOCK_QUANTIZATIONS = ("gguf", "compressed-tensors", "gptq", "awq", "mxfp4")
# Engine(kv_cache_dtype=...), vLLM's names: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3") and
# "fp8_e5m2" in one byte a value (runner/kv_cache.py).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, by `rope_type`:
    - "llama3": Llama 3.1's per-wavelength blend of `factor`, `low_freq_factor` and `high_freq_factor` around
      `original_max_position_embeddings`;
    - "linear": every frequency divided by `factor` (Gemma 3's global layers);
    - "frequency_factors": frequency i divided by `frequency_factors[i]` (llama.cpp stores Llama 3.1's scaling
      so, as a `rope_freqs` tensor);
    - "longrope" (Phi-3.5, Phi-4-mini): frequency factors `short_factor` for contexts within
      `original_max_position_embeddings`, `long_factor` beyond. An engine uses one set for every token, chosen by
      its max_model_len (`for_context`), as vLLM does: switching per sequence length, as transformers does, would
      leave keys cached under one set beside queries rotated by the other.
    Any type may scale cos and sin by `attention_factor` (longrope's length-dependent logit scale)."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    frequency_factors: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def uses_long_factors(self, max_model_len: int) -> bool:
        return self.rope_type == "longrope" and max_model_len > self.original_max_position_embeddings

    def for_context(self, max_model_len: int) -> RopeScaling:
        """The scaling an engine of this max_model_len runs: longrope resolved to one set of frequency factors."""
        if self.rope_type != "longrope":
            return self
        chosen = self.long_factor if self.uses_long_factors(max_model_len) else self.short_factor
        return RopeScaling(rope_type="frequency_factors", frequency_factors=chosen,
                           attention_factor=self.attention_factor)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the HF `architectures[0]` name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # a bias on the attention's output projection too (attention_bias: Llama's, gpt-oss)
    mlp_bias: bool = False  # biases on a dense MLP's gate, up and down projections (Llama's mlp_bias)
    # gpt-oss: a learned logit per q head that joins each softmax's denominator and attends to nothing
    attention_sinks: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head (its own gains, shared by heads) before RoPE
    sliding_window: int | None = None  # Mistral, when configured; with layer_types, the sliding layers' window
    # Per layer, "sliding_attention" or "full_attention", only when layers differ (Gemma 2/3, some Qwen2); () when
    # every layer attends alike. It describes the checkpoint's real layers: the runner carries each layer slot's
    # kind in the weights (`attn_kind`), padded like them for pipeline stages.
    layer_types: tuple[str, ...] = ()
    # SmolLM3: per layer, 1 where it applies RoPE and 0 where it does not (NoPE); () when every layer does.
    rope_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (no scaling); None: rope_theta
    rotary_dim: int | None = None  # Phi-4-mini: RoPE turns the first rotary_dim of each head's dims; None: all
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU), "gelu_tanh" (Gemma's GeGLU) or "gelu"
    # Gemma stores RMSNorm gains as w - 1 (it multiplies by 1 + w); the loader adds this to every norm gain.
    norm_weight_offset: float = 0.0
    # Granite: embeddings times embedding_multiplier, attention/MLP outputs times residual_multiplier before each
    # residual add, logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    post_norms: bool = False  # Gemma 2/3: an RMSNorm on the attention's and the MLP's outputs before each residual add
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Mixtral); 0 experts means a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_renormalize: bool = True  # the top-k router weights rescaled to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    # gpt-oss: biases on the router and on every expert matrix, and its clamped SwiGLU,
    # (up + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) and up clamped to [-limit, limit]
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    shared_expert_size: int = 0  # Qwen2-MoE: the MLP width of an expert every token runs, behind a sigmoid gate
    router_scoring: str = "softmax"  # the router's scores: "softmax" over the experts, or each expert's "sigmoid"
    # Whole experts split over tp (expert parallelism; Engine's enable_expert_parallel) instead of each expert's MLP
    # width. Set on the runner's effective config (parallel/layout.py), not by the checkpoint.
    expert_parallel: bool = False
    # Zero rows appended so the vocabulary / the experts split evenly over tensor-parallel devices. Set only on
    # the runner's effective config (parallel/layout.py); the model slices padded logits off and never routes to
    # padded experts.
    vocab_pad: int = 0
    expert_pad: int = 0
    # LoRA: adapter slots beside the layers' weights (0: none) and the rank each holds (Engine's max_loras and
    # max_lora_rank; set by the engine, not by the checkpoint: models/lora.py).
    lora_slots: int = 0
    lora_rank: int = 0
    # Activations quantized per token as the step runs, for matmuls in that type: "int8" (quantization="w8a8":
    # int8 weights, int32 sums) or "float8" (float8 weights on GPUs with FP8 matmuls: e4m3 x e4m3, float32 sums).
    # Set by the engine from its quantization and devices, not by the checkpoint.
    quantized_activations: str | None = None
    # A weight converted to float inside the step (kept groups, int8 and fp8 at load) whose float copy would pass
    # this many bytes is converted and multiplied a slice of its outputs at a time (layers.in_output_slices), so
    # that the copy stays in cache and under glibc's 32 MiB mmap threshold: XLA:CPU converts a weight whole before
    # its matmul. 0: whole weights. Set by the engine, on one CPU device.
    dequantize_slice_bytes: int = 0

    @property
    def matmul(self) -> dict:
        """The keyword arguments of layers.dense (and gated_mlp) for this model's matmuls."""
        return dict(activations=self.quantized_activations, slice_bytes=self.dequantize_slice_bytes)

    def __post_init__(self):
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router scoring {self.router_scoring!r} is not supported: jaxserve's mixture-of-experts "
                             f"routers score with {' or '.join(ROUTER_SCORINGS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs whole groups"
            )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def layers_differ(self) -> bool:
        """Whether layers differ in attention kind: then each carries its kind (`attn_kind`, from `layer_kinds`)."""
        return bool(self.layer_types or self.rope_layers)

    @property
    def window_kinds(self) -> tuple[int | None, ...]:
        """The window of each attention kind that applies RoPE: (sliding_window,) when every layer attends alike,
        else (None, sliding_window): kind 0 full, kind 1 sliding."""
        return (None, self.sliding_window) if self.layer_types else (self.sliding_window,)

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """The window of each attention kind: `window_kinds`, then, for models with NoPE layers, the same kinds
        again without RoPE (`layer_kinds` numbers the layers so)."""
        return self.window_kinds * 2 if self.rope_layers else self.window_kinds

    @property
    def rope_width(self) -> int:
        return self.rotary_dim or self.head_dim

    def for_context(self, max_model_len: int) -> ModelConfig:
        """This model as an engine of this max_model_len runs it (longrope's factors chosen)."""
        if self.rope_scaling is None:
            return self
        return dataclasses.replace(self, rope_scaling=self.rope_scaling.for_context(max_model_len))

    def layer_kinds(self) -> list[int]:
        """Each real layer's index into `attention_windows`, for models whose layers differ (`layers_differ`)."""
        kinds = [int(t == "sliding_attention") for t in self.layer_types] or [0] * self.num_layers
        if self.rope_layers:
            kinds = [k if rope else k + len(self.window_kinds) for k, rope in zip(kinds, self.rope_layers)]
        return kinds


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from memory at start


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = "float32"  # resolved: "float32" or "bfloat16"
    seed: int = 0
    max_logprobs: int = 20
    # The engine's `quantization` option as given (None: the default, which keeps a quantized checkpoint's own
    # quantization; runner/weights.resolve_quantization decides what is stored)
    quantization: str | None = None

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def resolve_dtype(dtype: str, platform: str) -> str:
    """`"auto"` is float32 on CPU (bf16 matmuls are slow there) and bfloat16 on GPU/TPU."""
    aliases = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
    if dtype == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    if dtype not in aliases:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'auto', 'float32' or 'bfloat16' (bfloat16 stands "
                         "in for float16: the same speed and memory, float32's range)")
    return aliases[dtype]


_NGRAM_NAMES = ("ngram", "[ngram]")  # vLLM once took the method as the draft "model" name
_VLLM_ONLY = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "deepseek_mtp", "mtp", "suffix")
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    method: str = "ngram"

    @classmethod
    def from_dict(cls, options: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """vLLM's dict (`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`) -> config;
        ValueError naming the bad key or value. A lookup bound left out takes the other's value; both left out
        are 5, vLLM's defaults."""
        if options is None or isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {type(options).__name__}")
        unknown = sorted(set(options) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
        method = options.get("method") or options.get("model")
        if method not in _NGRAM_NAMES:
            hint = " (a draft-model method vLLM has)" if method in _VLLM_ONLY else ""
            raise ValueError(f"speculative_config method {method!r}{hint} is not supported; jaxserve drafts with "
                             "method 'ngram' (prompt lookup)")
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs num_speculative_tokens, the tokens drafted per step (e.g. 4)")
        low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        for name, value in (("num_speculative_tokens", options["num_speculative_tokens"]),
                            ("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if (value is not None or name == "num_speculative_tokens") and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        # One bound given stands for both (vLLM's rule)
        low, high = (5, 5) if low is None and high is None else (high if low is None else low,
                                                                 low if high is None else high)
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} exceeds prompt_lookup_max={high}")
        return cls(options["num_speculative_tokens"], low, high)
