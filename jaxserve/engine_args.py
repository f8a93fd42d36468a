"""Every engine option, declared once: `EngineArgs`.

Each field is an option with its type, default, help and checks; the three ways users set options come from it:
`Engine(model, **options)` takes exactly these keywords, the command line's engine flags are generated from them
(cli/engine_options.py: vLLM's spellings and aliases are the fields' `flags`), and a batch job's `engine:` keys are
their names (batch/job_config.py). A field's `kind` says how a flag's text becomes its value (the CLI layer parses,
this module only checks values), `check` what values it accepts. Adding an option is adding a field.

Host side only: no jax.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jaxserve.config import (
    ATTENTION_IMPLS,
    BLOCK_QUANTIZATIONS,
    KV_CACHE_DTYPES,
    LAYER_LOOPS,
    MeshShape,
    SpeculativeConfig,
)

DEFAULT_COMPILATION_CACHE = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxserve" / "xla")
DTYPES = ("auto", "float32", "bfloat16", "float", "half", "float16")
QUANTIZATIONS = ("int8", "w8a8", "fp8", *BLOCK_QUANTIZATIONS, "none")
LOAD_FORMATS = ("auto", "dummy", "safetensors", "gguf", "pt")
RECOMPILE_GUARDS = ("warn", "error", "off")
CONTENT_FORMATS = ("auto", "string", "openai")

log = logging.getLogger("jaxserve.engine")

# vLLM's engine options that mean nothing under JAX, and why. Accepted with a warning saying so, as Engine keywords
# (most vLLM scripts pass trust_remote_code and enforce_eager to their LLM) and on the command line (cli/compat.py),
# so code and launch commands written for vLLM run unchanged.
PER_REQUEST_TASK = ("each request picks its task: completions and chat generate, /v1/embeddings, /classify and /score "
                    "pool, as the model's head allows")
VLLM_NO_EFFECT = {
    "enforce_eager": "JAX compiles each step program once; there are no CUDA graphs to leave out",
    "max_seq_len_to_capture": "there are no CUDA graphs; jaxserve compiles one program per batch bucket",
    "compilation_config": "XLA compiles every step program; there is no torch.compile to configure",
    "swap_space": "preempted sequences are recomputed, never swapped to host memory",
    "disable_custom_all_reduce": "XLA picks the collectives",
    "trust_remote_code": "jaxserve runs no code from model repositories (its models are its own)",
    "guided_decoding_backend": "structured outputs always use llguidance",
    "max_parallel_loading_workers": "weights load as one sharded read per process",
    "enable_chunked_prefill": "prefills are always chunked to --max-num-batched-tokens",
    "disable_log_stats": "an Engine logs no stats (the server's are --disable-log-stats)",
    "task": PER_REQUEST_TASK,
    "runner": PER_REQUEST_TASK,
    "limit_mm_per_prompt": "jaxserve serves text only: a request with image or audio parts is refused",
    "scheduling_policy": "requests always run in (priority, arrival) order, a lower priority first: first come, "
                         "first served where no request sets one",
    "structured_outputs_config": "structured outputs always use llguidance",
    "tokenizer_pool_size": "prompts are tokenized on the server's own threads",
    "num_scheduler_steps": "the next step is always scheduled while the current one runs (async scheduling)",
    "disable_async_output_proc": "outputs are read back while the next step runs, unless --no-async-scheduling",
    "preemption_mode": "a preempted sequence is always recomputed (vLLM's recompute mode), never swapped out",
    "model_impl": "jaxserve runs its own JAX implementation of every model it serves",
    "max_cpu_loras": "adapters are read from disk when loaded; there is no host-memory adapter cache to size",
    "prefix_caching_hash_algo": "prefix-cache blocks are keyed by jaxserve's own hash of their tokens",
    "enable_sleep_mode": "jaxserve has no sleep mode: the weights and KV cache stay in device memory",
    "cpu_offload_gb": "weights stay in device memory; none are offloaded to the host",
    "tokenizer_mode": "it uses the fast (Rust) tokenizer",
}
# Options whose vLLM default (0) is what jaxserve does, and whose other values it cannot honour.
VLLM_ZERO_ONLY = {"cpu_offload_gb"}
VLLM_NEGATABLE = {"enable_chunked_prefill"}  # its False (vLLM's --no-enable-chunked-prefill) is a choice too
# vLLM's --task values (its --runner's are auto, generate and pooling); those jaxserve has no counterpart for are
# refused when given.
VLLM_TASKS = ("auto", "generate", "embed", "embedding", "classify", "score", "reward", "transcription")
VLLM_RUNNERS = ("auto", "generate", "pooling")
UNSERVED_TASKS = {"reward": "reward models' per-token scores are not served",
                  "transcription": "speech models are not served"}


def vllm_no_effect(name: str, value) -> str | None:
    """Why vLLM's option `name` set to `value` changes nothing here, or None when it is left unset (None, or
    False for a switch). ValueError for a task jaxserve does not serve."""
    choices = {"task": VLLM_TASKS, "runner": VLLM_RUNNERS}.get(name)
    if choices and value is not None and value not in choices:
        raise ValueError(f"{name}={value!r} is not one of vLLM's: {', '.join(choices)}")
    if name == "task" and value in UNSERVED_TASKS:
        raise ValueError(f"task {value} is not supported: {UNSERVED_TASKS[value]}; leave the task out (each "
                         "request picks generation or pooling)")
    if name == "tokenizer_mode":  # auto and hf: the Hugging Face tokenizer jaxserve reads; slow: the same, fast
        if value in ("mistral", "custom"):
            raise ValueError(f"tokenizer_mode {value} is not supported: jaxserve reads Hugging Face tokenizers "
                             "(tokenizer.json); leave it out, or give a Hugging Face tokenizer")
        return VLLM_NO_EFFECT[name] if value == "slow" else None
    if name in VLLM_ZERO_ONLY and value not in (None, 0):
        raise ValueError(f"{name}={value} is not supported: {VLLM_NO_EFFECT[name]}; leave it out (0)")
    if value is None or (value is False and name not in VLLM_NEGATABLE) or name in VLLM_ZERO_ONLY:
        return None
    return VLLM_NO_EFFECT[name]


def without_vllm_no_effect(options: dict[str, Any], spelled: str) -> dict[str, Any]:
    """`options` less vLLM's that mean nothing here, each one set warned about (`spelled`: how the warning names
    it, from {name} and {value}); ValueError for what cannot be served (vllm_no_effect)."""
    for name in VLLM_NO_EFFECT.keys() & options.keys():
        if reason := vllm_no_effect(name, options[name]):
            log.warning("%s has no effect in jaxserve: %s", spelled.format(name=name, value=options[name]), reason)
    return {name: value for name, value in options.items() if name not in VLLM_NO_EFFECT}


# --- checks: each takes a value, returns it (normalised) or raises ValueError saying what is allowed -----------
def positive_int(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be a positive integer, got {value!r}")
    return value


def non_negative_int(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"must be a whole number >= 0, got {value!r}")
    return value


def any_int(value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be a whole number, got {value!r}")
    return value


def fraction(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {value!r}")
    return float(value)


def boolean(value):
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def text(value):
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {value!r}")
    return value


def path(value):
    """A file, directory or hub id: a string, or a path object (kept as its string)."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return text(value)


def mapping(value):
    if not isinstance(value, dict):
        raise ValueError(f"must be a mapping, got {value!r}")
    return value


def one_of(*allowed) -> Callable:
    def check(value):
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value

    return check


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30}


def readable_count(value, unit: str = "tokens") -> int | None:
    """A count as vLLM reads one: a positive whole number, or its readable form, 32k = 32,000 and 32K = 32,768
    (1.5k = 1,500; 4G = 4 GiB); "auto" or -1 leave it to the engine (None: the default)."""
    if value is None or value in ("auto", -1, "-1"):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return positive_int(value)
    example = "4096 or 32k" if unit == "tokens" else "4000000000 or 4G"
    if not isinstance(value, str):
        raise ValueError(f"must be a whole number of {unit} such as {example}, got {value!r}")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])?", value.strip())
    if match is None:
        raise ValueError(f"expected a whole number of {unit} such as {example} (or auto), got {value!r}")
    number, suffix = match.groups()
    multiplier = _DECIMAL_SUFFIXES.get(suffix) or _BINARY_SUFFIXES.get(suffix) or 1
    count = round(float(number) * multiplier, 6)  # 1.001 * 1000 is 1000.999...
    if count != int(count) or count < 1:
        raise ValueError(f"{value!r} is not a whole number of {unit} (>= 1)")
    return int(count)


def token_count(value) -> int | None:
    return readable_count(value, "tokens")


def byte_count(value) -> int | None:
    return readable_count(value, "bytes")


def logprobs_cap(value):
    if value == -1:  # vLLM's "no cap": every token's logprob
        raise ValueError("-1 (vLLM's 'no cap') is not supported: the compiled sampler keeps max_logprobs entries a "
                         "row; give the most a request may ask for, e.g. 20")
    return non_negative_int(value)


def optional(check: Callable) -> Callable:
    return lambda value: None if value is None else check(value)


def dtype_name(value):
    one_of(*DTYPES)(value)
    if value in ("float16", "half"):
        raise ValueError(f"{value!r} is not supported: use bfloat16 (the same memory; float16's range overflows "
                         "where bfloat16's does not)")
    return value


def mesh(value):
    return MeshShape.of(value)


def layer_counts(value):
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value):
        raise ValueError(f"must be decoder layers per pipeline stage, such as [8, 8, 7, 7], got {value!r}")
    return list(value)


def adapters(value):
    if not isinstance(value, dict) or not all(isinstance(k, str) and k and isinstance(v, str)
                                              for k, v in value.items()):
        raise ValueError("must map adapter names to adapter directories, e.g. {'sql': '/adapters/sql'}")
    return value


def anything(value):
    return value


def speculation(value):
    SpeculativeConfig.from_dict(value)  # raises a ValueError naming the key or value
    return value


def option(default, help: str, *, check: Callable | None = None, kind: str = "text", choices: tuple = (),
           flags: tuple[str, ...] = (), metavar: str | None = None, group: str = "engine",
           aliases: tuple[str, ...] = (), on_flags: tuple[str, ...] = (), cli: bool = True,
           job: bool = True):
    """An EngineArgs field.

    `kind`, how the command line reads it: "text", "int", "count" (a whole number >= 1), "tokens" / "bytes" (a
    count, or 32k = 32,000), "fraction", "json" (a JSON object), "speculative" / "generation" (JSON, checked by their own
    rules), "choice" (one of `choices`, which also make the check),
    "partition" (8,8,7,7), "mesh" (TPxPP), "adapters" (NAME=PATH ...), "switch" (a flag that sets True), "bool"
    (--x / --no-x), "off-switch" (its `flags` set False, e.g. --no-warmup; `on_flags` set True). `flags`: the
    option strings (default --field-name). `aliases`: other names a job file or a keyword may use (vLLM's). `cli` / `job`: offered on the
    command line / in job files."""
    if choices:
        kind = "choice"
        check = check or (optional(one_of(*choices)) if default is None else one_of(*choices))
    check = check or anything
    return field(default=default, metadata=dict(help=help, check=check, kind=kind, choices=choices, flags=flags,
                                                metavar=metavar,
                                                group=group, aliases=aliases, on_flags=on_flags, cli=cli, job=job))


@dataclass(frozen=True)
class EngineArgs:
    """The engine's options, with vLLM's names where vLLM has the option (`help(EngineArgs)` lists them)."""

    model: str | None = option(
        None, "model id, directory or .gguf file (default: SmolLM2-135M-Instruct)", check=optional(path), cli=False)
    # --- parallelism
    mesh: MeshShape | str | tuple | None = option(
        None, "device mesh: tensor-parallel x pipeline-parallel devices, e.g. 8x2", check=optional(mesh),
        kind="mesh", metavar="TPxPP", group="parallelism")
    tensor_parallel_size: int | None = option(
        None, "tensor-parallel devices (instead of --mesh)", check=optional(positive_int), kind="count",
        flags=("-tp", "--tensor-parallel-size"), metavar="N", group="parallelism")
    pipeline_parallel_size: int | None = option(
        None, "pipeline stages (instead of --mesh)", check=optional(positive_int), kind="count",
        flags=("-pp", "--pipeline-parallel-size"), metavar="M", group="parallelism")
    pp_layer_partition: list[int] | None = option(
        None, "decoder layers per pipeline stage, e.g. 8,8,7,7 (default: even, the remainder going to the stages "
        "before the last, as in vLLM)", check=optional(layer_counts), kind="partition", metavar="N,N,...",
        group="parallelism")
    enable_expert_parallel: bool = option(
        False, "split a mixture of experts' whole experts over the tensor-parallel devices (E/tp each) instead of "
        "each expert's MLP width, as vLLM's flag does", check=boolean, kind="switch", group="parallelism")
    devices: Any = option(None, "the devices the mesh is built from (default: the first tp x pp of jax.devices())",
                          cli=False, job=False)
    # --- the model and its files
    dtype: str = option(
        "auto", "weights and activations (auto: float32 on CPU, bfloat16 on GPU/TPU; float is float32; float16 is "
        "not supported, bfloat16 replaces it)", choices=DTYPES, check=dtype_name)
    quantization: str | None = option(
        None, "int8: weight-only int8 with per-channel scales (a quarter of float32's weight bytes, faster "
        "memory-bound decode); w8a8: those weights times int8 activations quantized per token (integer matmuls); "
        "fp8: weight-only float8 e4m3 with per-channel scales (vLLM's dynamic FP8 weights), or an FP8 checkpoint's "
        "own float8 blocks kept; gguf, compressed-tensors, gptq, awq: a checkpoint quantized that way kept in its "
        "own blocks (GGUF Q4_0/Q4_1/Q4_K in 4 bits, Q5/Q6_K/Q8_0 in 8; W4A16/W8A16/FP8; GPTQ 4/8-bit; AWQ 4-bit). "
        "Keeping a checkpoint's quantization is the default (a CPU dequantizes float8 and float4 values at load, "
        "faster there); none: a quantized checkpoint's weights dequantized at load, served in float. "
        "docs/quantization.md has the accuracy of each", choices=QUANTIZATIONS,
        flags=("--quantization", "-q"))
    load_format: str = option(
        "auto", "dummy: random weights for the model's config (no weight files needed; benchmarks); auto reads "
        "safetensors or GGUF, whichever the model has (pt files are not read)", choices=LOAD_FORMATS)
    hf_overrides: dict | None = option(
        None, "keys laid over the model's config.json, as in vLLM: '{\"max_position_embeddings\": 65536, "
        "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 2.0, \"original_max_position_embeddings\": 32768}}'",
        check=optional(mapping), kind="json", metavar="JSON")
    revision: str | None = option(None, "branch, tag or commit of a hub model id", check=optional(text),
                                  metavar="REV")
    tokenizer: Any = option(
        None, "serve with this Hugging Face tokenizer instead of the model's own (a directory or hub id, e.g. a GGUF "
        "file's original model; in Python also a tokenizer object)", metavar="DIR|HUB_ID")
    tokenizer_revision: str | None = option(None, "branch, tag or commit of a hub --tokenizer",
                                            check=optional(text), metavar="REV")
    download_dir: str | None = option(
        None, "where hub models and tokenizers are downloaded to (default: the Hugging Face cache)",
        check=optional(path), metavar="DIR")
    chat_template: str | None = option(
        None, "a Jinja chat template, or a file holding one, to use instead of the tokenizer's (a model without one "
        "needs it for /v1/chat/completions)", check=optional(path), metavar="TEMPLATE")
    chat_template_content_format: str = option(
        "auto", "how message contents reach the chat template: string (text parts joined), openai (a list of "
        "{'type': 'text', 'text': ...} parts) or auto (openai when the template loops over a message's content), as "
        "in vLLM", choices=CONTENT_FORMATS)
    generation_config: str = option(
        "auto", "where requests' sampling defaults come from, as in vLLM: the model's generation_config.json (auto), "
        "OpenAI's defaults (vllm), or DIR's", check=path, metavar="auto|vllm|DIR")
    override_generation_config: dict | None = option(
        None, "sampling defaults laid over those, as in vLLM: '{\"temperature\": 0.6, \"top_p\": 0.95}'",
        check=optional(mapping), kind="generation", metavar="JSON")
    # --- capacity and scheduling
    max_model_len: int | None = option(
        None, "context length (prompt + output); on the command line and in --config files 32k is 32,000 and 32K "
        "32,768, as in vLLM",
        check=token_count, kind="tokens", metavar="N")
    max_num_seqs: int | None = option(
        None, "most sequences in one step (default: 64 on CPU, 256 on GPU/TPU)", check=optional(positive_int),
        kind="count", metavar="N")
    max_num_batched_tokens: int | None = option(
        None, "most tokens in one step, prefill chunks cut to fit (default: 512 on CPU, 8192 on GPU/TPU)",
        check=token_count, kind="tokens", metavar="N")
    block_size: int = option(16, "tokens per KV block", check=positive_int, kind="count", metavar="N")
    num_kv_blocks: int | None = option(
        None, "KV cache blocks (default: sized from free device memory; on CPU, from host memory, at most what "
        "max_num_seqs sequences of max_model_len fill)", check=optional(positive_int), kind="count",
        flags=("--num-kv-blocks", "--num-gpu-blocks-override"), metavar="N", aliases=("num_gpu_blocks_override",))
    kv_cache_memory_fraction: float = option(
        0.9, "share of each accelerator's memory the engine fills: weights, activations, then the KV cache in what "
        "is left (as in vLLM; ignored with --num-kv-blocks; default 0.9)", check=fraction, kind="fraction",
        flags=("--gpu-memory-utilization",), metavar="FRACTION", aliases=("gpu_memory_utilization",))
    kv_cache_memory_bytes: int | None = option(
        None, "bytes of each device's memory the KV cache takes (as vLLM's; 4G = 4 GiB): the cache sized from it, "
        "not from a profiling step and --gpu-memory-utilization; ignored with --num-kv-blocks", check=byte_count,
        kind="bytes", metavar="BYTES")
    kv_cache_dtype: str = option(
        "auto", "auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 stores K/V in one byte a value, twice a bf16 "
        "cache's tokens in the same memory (unscaled, as vLLM without scales)", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = option(
        True, "share the KV blocks of a common prompt prefix between requests (default: on)",
        check=lambda value: True if value is None else boolean(value), kind="bool")  # None: vLLM's "default"
    async_scheduling: bool = option(
        True, "read each step back before scheduling the next (by default the next step is dispatched first, so "
        "host work overlaps device work; for debugging)", check=boolean, kind="off-switch",
        flags=("--no-async-scheduling",), on_flags=("--async-scheduling",))
    seed: int = option(0, "seed of requests that set none", check=any_int, kind="int")
    max_logprobs: int = option(20, "largest logprobs / top_logprobs a request may ask for", check=logprobs_cap,
                               kind="int", metavar="N")
    speculative_config: dict | None = option(
        None, "speculative decoding, as in vLLM: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4}' drafts tokens by looking the latest ones up earlier in the sequence (faster on "
        "outputs that copy their input; the tokens are unchanged)", check=optional(speculation), kind="speculative",
        metavar="JSON")
    # --- compiling
    attention_impl: str = option(
        "auto", "auto: the Pallas kernels on GPU/TPU (on a GPU jax's Triton backend lists), the XLA reference on "
        "CPU; pallas-interpret runs the kernels in Pallas's interpreter (slow; for debugging)",
        choices=ATTENTION_IMPLS)
    layer_loop: str = option(
        "auto", "auto: unrolled over per-layer weights on GPU, for mixtures of experts and, on CPU, for "
        "float8/float4 weights (each matmul reads its weights in place), one scan over stacked weights elsewhere "
        "(faster compiles)", choices=LAYER_LOOPS)
    warmup: bool = option(
        True, "compile step programs when first needed instead of at start-up (faster start, slower first "
        "requests)", check=boolean, kind="off-switch", flags=("--no-warmup",))
    recompile_guard: str = option(
        "warn", "what a step that compiles a program after warm-up does: warn (log it), error (raise) or off",
        choices=RECOMPILE_GUARDS)
    compilation_cache_dir: str | None = option(
        DEFAULT_COMPILATION_CACHE, "where compiled step programs are kept between runs ('' or none turns the cache "
        "off; default: ~/.cache/jaxserve/xla, under $XDG_CACHE_HOME when set)", check=optional(path), metavar="DIR")
    # --- LoRA
    enable_lora: bool = option(False, "give the model adapter slots (implied by --lora-modules)", check=boolean,
                               kind="switch", group="LoRA adapters (vLLM's options)")
    lora_modules: dict[str, str] | None = option(
        None, "PEFT LoRA adapter directories, each served as model NAME (a request's \"model\" picks it); loaded at "
        "start", check=optional(adapters), kind="adapters", metavar="NAME=PATH",
        group="LoRA adapters (vLLM's options)")
    max_loras: int = option(1, "adapter slots on the devices (default 1; raised to the number of --lora-modules)",
                            check=positive_int, kind="count", metavar="N", group="LoRA adapters (vLLM's options)")
    max_lora_rank: int = option(16, "largest adapter rank a slot holds (default 16)", check=positive_int,
                                kind="count", metavar="R", group="LoRA adapters (vLLM's options)")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            try:
                value = f.metadata["check"](getattr(self, f.name))
            except ValueError as exc:
                raise ValueError(f"{f.name} {exc}") from None
            object.__setattr__(self, f.name, value)
        if self.compilation_cache_dir in ("", "none"):  # a directory named none: ./none
            object.__setattr__(self, "compilation_cache_dir", None)
        if self.mesh is not None and (self.tensor_parallel_size, self.pipeline_parallel_size) != (None, None):
            MeshShape.of(self.mesh, self.tensor_parallel_size, self.pipeline_parallel_size)  # raises: not both

    @classmethod
    def of(cls, model: str | None = None, /, **options) -> EngineArgs:
        """From keywords (`Engine(model, **options)`), vLLM's alias names included, and its options that mean
        nothing here (VLLM_NO_EFFECT) accepted with a warning; an unknown keyword is a TypeError naming it and the
        options there are."""
        names = {f.name: f.name for f in dataclasses.fields(cls)}
        names |= {alias: f.name for f in dataclasses.fields(cls) for alias in f.metadata["aliases"]}
        given = {}
        for key, value in without_vllm_no_effect(options, "Engine({name}={value!r})").items():
            if key not in names:
                raise TypeError(f"Engine has no option {key!r}; its options are {', '.join(option_names())}")
            given[names[key]] = value
        return cls(model=model, **given)

    @property
    def mesh_shape(self) -> MeshShape:
        return MeshShape.of(self.mesh, self.tensor_parallel_size, self.pipeline_parallel_size)

    def engine_kwargs(self) -> dict[str, Any]:
        """`Engine(self.model, **engine_kwargs())` is the Engine these options describe: every option, the mesh
        as one MeshShape."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("model", "mesh", "tensor_parallel_size", "pipeline_parallel_size")}
        return values | {"mesh": self.mesh_shape}

    def changed(self) -> dict[str, Any]:
        """The options set to something other than their default."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


def option_fields(surface: str | None = None) -> list[dataclasses.Field]:
    """EngineArgs' fields, or those offered on `surface` ("cli" or "job")."""
    return [f for f in dataclasses.fields(EngineArgs) if surface is None or f.metadata[surface]]


def engine_signature() -> inspect.Signature:
    """`Engine.__init__`'s signature as help() and editors show it: self, model, then every option as a keyword."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
               for f in dataclasses.fields(EngineArgs) if f.name != "model"]
    return inspect.Signature(params)


def option_names() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]


def check_option(name: str, value):
    """One option's value, checked as EngineArgs checks it (a job file's key, say): ValueError without the name."""
    f = next(f for f in dataclasses.fields(EngineArgs) if f.name == name)
    return f.metadata["check"](value)
