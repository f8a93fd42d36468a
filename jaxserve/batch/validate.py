"""`jaxserve batch --validate job.yaml`: check the job file and every input line without loading the model.

Each request body goes through the same parsing and SamplingParams checks the run applies (and the HTTP API);
what needs the model (prompt lengths, the chat template) is left to the run, where it becomes a 400 record.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from jaxserve.batch.endpoints import parse_body
from jaxserve.batch.input_file import InputScan, scan_input
from jaxserve.batch.job_config import BatchJob, load_job
from jaxserve.batch.problems import JobError
from jaxserve.batch.result_log import read_results
from jaxserve.errors import UserError
from jaxserve.loader.model_name import served_name
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import request_origin


@dataclass
class ValidationReport:
    facts: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = list(self.facts)
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s):")
            lines += [f"  {problem}" for problem in self.problems]
        else:
            lines.append("no problems found")
        return "\n".join(lines)


def validate_job(path: str | Path) -> ValidationReport:
    report = ValidationReport()
    try:
        job = load_job(path)
    except JobError as exc:
        report.problems += exc.problems
        return report
    scan = scan_input(job.input)
    report.facts += _input_facts(job, scan)
    report.problems += scan.duplicates + [bad.message for bad in scan.bad_lines] + _body_problems(job, scan)
    try:
        report.facts.append(_progress_fact(job, scan))
    except UserError as exc:  # an output file this job would refuse to touch
        report.problems.append(str(exc))
    return report


def _input_facts(job: BatchJob, scan: InputScan) -> list[str]:
    by_url = ", ".join(f"{count} {url}" for url, count in scan.count_by_url().items())
    models = Counter(item.body.get("model") or job.sampling.get("model") for item in scan.items)
    named = ", ".join(f"{name or 'none given'} ({count})" for name, count in models.most_common())
    facts = [f"model: {job.model or 'the built-in default (SmolLM2-135M-Instruct)'}",
             f"input: {job.input}: {len(scan.entries)} lines, {len(scan.items)} requests ({by_url}), "
             f"{len(scan.bad_lines)} malformed"]
    if any(models):
        facts.append(f"models named in bodies: {named}")
    return facts


def _body_problems(job: BatchJob, scan: InputScan) -> list[str]:
    """Every body checked as the HTTP API would check it (schema, sampling values, the model's name)."""
    problems = []
    names = job.served_model_name or [served_name(job.model)]  # as the run resolves bodies' names
    adapters = list(job.engine.lora_modules or {})
    for item in scan.items:
        try:
            with request_origin(item.origin):
                request, _ = parse_body(item.url, item.body, job.sampling)
        except APIError as exc:
            problems.append(f"{item.where}: {exc.message}")
            continue
        if request.model and request.model not in names + adapters:
            served = (f"served_model_name is {', '.join(names)}" if job.served_model_name else
                      f"the job serves its model as {names[0]!r} (set served_model_name to the name the bodies use)")
            problems.append(f"{item.where}: model {request.model!r} is not served; {served}"
                            + (f" and the LoRA adapters are {', '.join(adapters)}" if adapters else ""))
    return problems


def _progress_fact(job: BatchJob, scan: InputScan) -> str:
    files = [read_results(job.output), read_results(job.errors)]
    done = set().union(*(results.succeeded_keys for results in files))
    failed = sum(results.failed for results in files)
    finished = sum(1 for entry in scan.entries if entry.key in done)
    retry = f"; the {failed} that failed run again" if failed else ""
    if not finished:
        return f"output: {job.output} (nothing done yet{retry})"
    return f"output: {job.output} ({finished} of {len(scan.entries)} lines already done; a run resumes{retry})"
