"""The batch job file (YAML): which model, engine options, sampling defaults, input/output paths.

Checked with pydantic before anything heavy happens; every problem is reported as a sentence naming the key.
Relative paths (input, output, errors, a local model file) resolve against the job file's directory, so a job
runs the same from any working directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationInfo, field_validator, model_validator

from jaxserve.batch.problems import JobError, describe_validation_error
from jaxserve.config import MeshShape
from jaxserve.engine_args import check_option, option_fields, without_vllm_no_effect
from jaxserve.loader.generation_config import GENERATION_CONFIG_SOURCES, check_overrides
from jaxserve.loader.model_name import check_adapter_names, served_name
from jaxserve.loader.tokenizer import is_template_text
from jaxserve.server.reasoning_parsers import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS


class _EngineOptionsBase(BaseModel):
    """A job's `engine:` section: any EngineArgs option (engine_args.py) by its name or vLLM's alias, checked by the
    same rules as `Engine(...)`'s keywords, plus `data_parallel_size`; anything left out keeps the Engine's
    default. Relative paths (a chat template file, a tokenizer or generation-config directory, adapters) resolve
    against the job file's directory."""

    model_config = ConfigDict(extra="forbid")

    # Replicas of the model, each on its own mesh of devices; the job's lines go to whichever has room (serve -dp).
    data_parallel_size: PositiveInt = 1

    @model_validator(mode="before")
    @classmethod
    def _vllm_options_without_effect(cls, data: Any) -> Any:
        """vLLM's options that mean nothing here (trust_remote_code...) taken with a warning, as Engine takes them."""
        # (a ValueError, for what cannot be served, is named as the job's problem)
        return without_vllm_no_effect(data, "engine.{name}") if isinstance(data, dict) else data

    @field_validator("*", mode="after")
    @classmethod
    def _checked(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if value is None or name == "data_parallel_size":
            return value
        value = check_option(name, value)  # a ValueError says what is allowed; pydantic names the key
        if name == "override_generation_config":
            value = check_overrides(value)
        return _beside_the_job(name, value, Path((info.context or {}).get("base_dir", ".")))

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `Engine(...)`: only what the job set, with -tp/-pp folded into the mesh."""
        given = {name: getattr(self, name) for name in self.model_fields_set if getattr(self, name) is not None}
        given.pop("data_parallel_size", None)
        tp, pp = given.pop("tensor_parallel_size", None), given.pop("pipeline_parallel_size", None)
        if "mesh" in given or tp or pp:
            given["mesh"] = MeshShape.of(given.get("mesh"), tp, pp)
        return given


def _beside_the_job(name: str, value: Any, base_dir: Path) -> Any:
    if name in ("chat_template", "tokenizer", "generation_config") and not isinstance(value, str):
        raise ValueError(f"must be a path{' or hub id' if name == 'tokenizer' else ''} (text), got {value!r}")
    if name == "chat_template" and not is_template_text(value):
        return str(base_dir / Path(value).expanduser())
    if name == "tokenizer":
        beside = base_dir / Path(value).expanduser()
        return str(beside) if beside.exists() else value  # else a hub id
    if name == "generation_config" and value not in GENERATION_CONFIG_SOURCES:
        return str(base_dir / Path(value).expanduser())
    if name == "lora_modules":
        return {adapter: str(base_dir / Path(path).expanduser()) for adapter, path in value.items()}
    return value


def _option(f) -> tuple[Any, Any]:
    aliases = f.metadata["aliases"]
    return Any, pydantic.Field(default=None, validation_alias=pydantic.AliasChoices(f.name, *aliases) if aliases
                               else None)


EngineOptions = pydantic.create_model(
    "EngineOptions", __base__=_EngineOptionsBase,
    **{f.name: _option(f) for f in option_fields("job") if f.name != "model"})


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

    @model_validator(mode="after")
    def _adapters_named_apart_from_the_model(self) -> BatchJob:
        check_adapter_names(self.served_model_name or [served_name(self.model)], self.engine.lora_modules or {})
        return self

    @field_validator("sampling", mode="before")
    @classmethod
    def _empty_sampling(cls, sampling: Any) -> Any:
        return {} if sampling is None else sampling


def read_job_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise JobError(path, ["no such file; check the path"])  # JobError names the file
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
    if job.input.is_dir():
        problems.append(f"input {job.input} is a directory; give the JSONL file of requests")
    elif not job.input.exists():
        problems.append(f"input file {job.input} does not exist")
    for key in ("output", "errors"):
        target = getattr(job, key)
        if target is None:
            continue
        if target == job.input or _same_file(target, job.input):  # a hard link too: results would overwrite it
            problems.append(f"{key} is the input file {target}; results must go to a different file")
        elif target.is_dir():
            problems.append(f"{key} {target} is a directory; give a file path (e.g. {target / 'results.jsonl'})")
        elif not target.parent.is_dir():
            problems.append(f"{key} directory {target.parent} does not exist; create it first")
        elif not os.access(target if target.exists() else target.parent, os.W_OK):
            problems.append(f"{key} {target} cannot be written (permissions, or a read-only file system)")
    if job.errors is not None and job.errors == job.output:
        problems.append("errors and output are the same file; leave `errors` out to put failures in the output")
    return problems


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:  # one of them does not exist (yet)
        return False


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
