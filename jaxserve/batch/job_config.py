"""The batch job file (YAML): which model, engine options, sampling defaults, input/output paths.

Checked with pydantic before anything heavy happens; every problem is reported as a sentence naming the key.
Relative paths (input, output, errors, a local model file) resolve against the job file's directory, so a job
runs the same from any working directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationInfo, field_validator

from jaxserve.batch.problems import JobError, describe_validation_error
from jaxserve.config import ATTENTION_IMPLS, KV_CACHE_DTYPES, LAYER_LOOPS, MeshShape, SpeculativeConfig
from jaxserve.loader.chat_content import CONTENT_FORMATS
from jaxserve.loader.generation_config import GENERATION_CONFIG_SOURCES, check_overrides
from jaxserve.loader.tokenizer import is_template_text
from jaxserve.server.reasoning_parsers import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS


class EngineOptions(BaseModel):
    """Engine keyword arguments a job may set; anything left out keeps the Engine's default."""

    model_config = ConfigDict(extra="forbid")

    mesh: str | None = None
    tensor_parallel_size: PositiveInt | None = None
    pipeline_parallel_size: PositiveInt | None = None
    # Replicas of the model, each on its own mesh of devices; the job's lines go to whichever has room (serve -dp).
    data_parallel_size: PositiveInt = 1
    dtype: Literal["auto", "float32", "bfloat16"] | None = None
    quantization: Literal["int8", "w8a8"] | None = None
    load_format: Literal["auto", "dummy"] | None = None
    max_model_len: PositiveInt | None = None
    block_size: PositiveInt | None = None
    num_kv_blocks: PositiveInt | None = None
    # vLLM's name for it is accepted too.
    kv_cache_memory_fraction: float | None = pydantic.Field(
        default=None, gt=0, le=1, validation_alias=pydantic.AliasChoices("kv_cache_memory_fraction",
                                                                         "gpu_memory_utilization"))
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    max_logprobs: pydantic.NonNegativeInt | None = None
    seed: int | None = None
    enable_prefix_caching: bool | None = None
    warmup: bool | None = None
    async_scheduling: bool | None = None
    recompile_guard: Literal["warn", "error", "off"] | None = None
    attention_impl: Literal[ATTENTION_IMPLS] | None = None
    layer_loop: Literal[LAYER_LOOPS] | None = None
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] | None = None
    compilation_cache_dir: str | None = None
    chat_template: str | None = None  # a Jinja chat template or a file holding one (relative: to the job file)
    chat_template_content_format: Literal[CONTENT_FORMATS] | None = None  # contents as a string or text parts
    tokenizer: str | None = None  # a tokenizer directory (relative: to the job file) or hub id, as vLLM's
    revision: str | None = None  # of a hub model id
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # where hub models and tokenizers are downloaded to
    # LoRA adapters (name -> PEFT adapter directory, relative: to the job file); a body's `model` picks one.
    enable_lora: bool | None = None
    max_loras: PositiveInt | None = None
    max_lora_rank: PositiveInt | None = None
    lora_modules: dict[str, str] | None = None
    # vLLM's speculative_config mapping, e.g. {method: ngram, num_speculative_tokens: 4}
    speculative_config: dict[str, Any] | None = None
    hf_overrides: dict[str, Any] | None = None  # keys laid over the model's config.json, as in vLLM
    # Where sampling defaults come from (auto, vllm or a directory) and what is laid over them, as in vLLM; the
    # job's own `sampling` section is laid over both.
    generation_config: str | None = None
    override_generation_config: dict[str, Any] | None = None

    @field_validator("mesh", mode="before")
    @classmethod
    def _mesh_form(cls, mesh: Any) -> Any:
        return None if mesh is None else str(MeshShape.parse(str(mesh)))  # a ValueError names the form

    @field_validator("speculative_config", mode="after")
    @classmethod
    def _known_speculation(cls, options: dict[str, Any] | None) -> dict[str, Any] | None:
        SpeculativeConfig.from_dict(options)  # a ValueError names the key or value, as the Engine would
        return options

    @field_validator("chat_template", mode="after")
    @classmethod
    def _template_file_beside_the_job(cls, template: str | None, info: ValidationInfo) -> str | None:
        if template is None or is_template_text(template):
            return template
        return str(Path((info.context or {}).get("base_dir", ".")) / Path(template).expanduser())

    @field_validator("tokenizer", mode="after")
    @classmethod
    def _tokenizer_beside_the_job(cls, tokenizer: str | None, info: ValidationInfo) -> str | None:
        if tokenizer is None:
            return None
        beside = Path((info.context or {}).get("base_dir", ".")) / Path(tokenizer).expanduser()
        return str(beside) if beside.exists() else tokenizer  # else a hub id

    @field_validator("override_generation_config", mode="after")
    @classmethod
    def _known_generation_defaults(cls, overrides: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if overrides is None else check_overrides(overrides)  # a ValueError names the key or value

    @field_validator("generation_config", mode="after")
    @classmethod
    def _generation_config_beside_the_job(cls, source: str | None, info: ValidationInfo) -> str | None:
        if source is None or source in GENERATION_CONFIG_SOURCES:
            return source
        return str(Path((info.context or {}).get("base_dir", ".")) / Path(source).expanduser())

    @field_validator("lora_modules", mode="after")
    @classmethod
    def _adapters_beside_the_job(cls, modules: dict[str, str] | None, info: ValidationInfo) -> dict[str, str] | None:
        if modules is None:
            return None
        base_dir = Path((info.context or {}).get("base_dir", "."))
        return {name: str(base_dir / Path(path).expanduser()) for name, path in modules.items()}

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `Engine(...)`: only what the job set, with -tp/-pp folded into the mesh."""
        kwargs = self.model_dump(exclude_none=True, exclude={"tensor_parallel_size", "pipeline_parallel_size",
                                                             "data_parallel_size"})
        if self.mesh is not None or self.tensor_parallel_size or self.pipeline_parallel_size:
            kwargs["mesh"] = MeshShape.of(self.mesh, self.tensor_parallel_size, self.pipeline_parallel_size)
        return kwargs


class BatchJob(BaseModel):
    """A whole job file. Validate with `context={"base_dir": <the file's directory>}`."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the built-in default model
    served_model_name: list[str] | None = None  # names bodies may give as `model` (default: the model's name)
    engine: EngineOptions = pydantic.Field(default_factory=EngineOptions)
    sampling: dict[str, Any] = pydantic.Field(default_factory=dict)  # defaults under each body; the body wins
    input: Path
    output: Path
    errors: Path | None = None  # failed requests go here when set, else into `output`
    max_concurrency: PositiveInt | None = None  # requests in the engine at once (default: 4 x max_num_seqs)
    # How the model writes tool calls, for chat bodies with tool_choice "auto" (serve --tool-call-parser).
    tool_call_parser: Literal[tuple(TOOL_CALL_PARSERS)] | None = None
    # How the model writes its reasoning, split into chat messages' `reasoning` (serve --reasoning-parser).
    reasoning_parser: Literal[tuple(REASONING_PARSERS)] | None = None

    @field_validator("input", "output", "errors", mode="after")
    @classmethod
    def _resolve_path(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        if path is None:
            return None
        return (Path(info.context["base_dir"]) / path.expanduser()).resolve()

    @field_validator("model", mode="after")
    @classmethod
    def _resolve_local_model(cls, model: str | None, info: ValidationInfo) -> str | None:
        """A model that is plainly a local path resolves against the job file; a hub id stays as it is."""
        if model is None:
            return None
        candidate = Path(info.context["base_dir"]) / Path(model).expanduser()
        looks_local = model.startswith((".", "/", "~")) or model.endswith(".gguf") or candidate.exists()
        if not looks_local:
            return model
        if not candidate.exists():
            raise ValueError(f"model file {candidate} does not exist; give an existing .gguf file or model "
                             "directory (relative paths start at the job file's directory), or leave `model` out "
                             "for the built-in default model")
        return str(candidate.resolve())

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_or_more_names(cls, names: Any) -> Any:
        return [names] if isinstance(names, str) else names

    @field_validator("sampling", mode="before")
    @classmethod
    def _empty_sampling(cls, sampling: Any) -> Any:
        return {} if sampling is None else sampling


def read_job_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise JobError(path, [f"job file {path} does not exist; check the path"])
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise JobError(path, [f"not valid YAML{where}: {getattr(exc, 'problem', None) or exc}"]) from None
    if not isinstance(content, dict):
        raise JobError(path, ["must be a mapping with at least `input:` and `output:` keys"])
    return {str(key).replace("-", "_"): value for key, value in content.items()}


def load_job(path: str | Path, check_paths: bool = True) -> BatchJob:
    """The checked job; a JobError listing every problem (unknown keys, bad values, clashing paths).
    `check_paths=False`: for a process that never opens the input and output (a multi-node follower)."""
    path = Path(path)
    try:
        job = BatchJob.model_validate(read_job_mapping(path), context={"base_dir": path.parent})
    except pydantic.ValidationError as exc:
        raise JobError(path, [describe_validation_error(error, BatchJob) for error in exc.errors()]) from None
    problems = (_path_problems(job) if check_paths else []) + _engine_problems(job) + _sampling_problems(job)
    if problems:
        raise JobError(path, problems)
    return job


def _path_problems(job: BatchJob) -> list[str]:
    problems = []
    if not job.input.is_file():
        problems.append(f"input file {job.input} does not exist")
    for key in ("output", "errors"):
        target = getattr(job, key)
        if target is None:
            continue
        if target == job.input:
            problems.append(f"{key} is the input file {target}; results must go to a different file")
        elif not target.parent.is_dir():
            problems.append(f"{key} directory {target.parent} does not exist; create it first")
    if job.errors is not None and job.errors == job.output:
        problems.append("errors and output are the same file; leave `errors` out to put failures in the output")
    return problems


def _engine_problems(job: BatchJob) -> list[str]:
    from jaxserve.loader.tokenizer import read_chat_template

    try:
        job.engine.engine_kwargs()
        if job.engine.chat_template is not None:
            read_chat_template(job.engine.chat_template)
    except ValueError as exc:
        return [str(exc)]
    return []


def _sampling_problems(job: BatchJob) -> list[str]:
    from jaxserve.batch.endpoints import sampling_default_problems  # the server schemas: only when needed

    return sampling_default_problems(job.sampling)
