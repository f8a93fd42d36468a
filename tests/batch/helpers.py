"""Building batch jobs in a test's tmp_path, and reading their results."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

# A small engine starts fast on CPU: few step buckets; a fixed small KV cache (no profiling step, and steps that
# do not drag a cache sized to all free memory along); programs compiled as first used rather than all up front.
SMALL_ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 128, "max_model_len": 512, "num_kv_blocks": 256,
                "warmup": False}


def completion_line(custom_id: str, prompt, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


def embedding_line(custom_id: str, input, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"input": input, **body}}


def pooled_line(custom_id: str, url: str, **body) -> dict:
    """A line to a pooling endpoint: /v1/score, /v1/rerank, /v1/classify or another spelling of them."""
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat_line(custom_id: str, content: str, **body) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": messages, **body}}


def write_jsonl(path: Path, lines: list) -> Path:
    """Dicts become JSON lines; strings are written as they are (to make malformed lines)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def write_job(directory: Path, lines: list, name: str = "job.yaml", **job) -> Path:
    """input.jsonl with `lines`, and a job file writing out.jsonl next to it; `job` adds or overrides keys."""
    write_jsonl(directory / "input.jsonl", lines)
    path = directory / name
    path.write_text(yaml.safe_dump({"input": "input.jsonl", "output": "out.jsonl", **job}))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Close(list):
    """An embedding, equal to another within float tolerance: the same prompt batched with other requests runs in
    another step shape, which may change the last bits."""

    def __eq__(self, other) -> bool:
        return len(self) == len(other) and bool(np.allclose(self, other, atol=1e-5))


def comparable_body(body: dict) -> dict:
    """A response body without what differs between two runs of the same request (its id and time)."""
    body = {key: value for key, value in body.items() if key not in ("id", "created")}
    if body.get("object") == "list":  # embeddings, class probabilities, scores
        body["data"] = [{**d, **{key: Close(d[key] if key in ("embedding", "probs") else [d[key]])
                                 for key in ("embedding", "probs", "score") if key in d}} for d in body["data"]]
    if "results" in body:  # a ranking
        body["results"] = [{**r, "relevance_score": Close([r["relevance_score"]])} for r in body["results"]]
    return body


def results_by_custom_id(path: Path) -> dict[str, dict]:
    """custom_id -> (status, comparable body or error message); asserts one line per custom_id."""
    records = read_jsonl(path)
    ids = [record["custom_id"] for record in records]
    assert len(ids) == len(set(ids)), "a custom_id has more than one result line"
    return {record["custom_id"]: _comparable(record) for record in records}


def _comparable(record: dict):
    response = record["response"]
    if response is None:
        return None, record["error"]["message"]
    return response["status_code"], comparable_body(response["body"])


def answers_over_http(engine, lines: list[dict], sampling: dict, served_model_names: list[str]) -> dict:
    """custom_id -> (status, comparable body) from the real HTTP app over `engine`, each line POSTed as a client
    would (the job's sampling defaults written into the body). The engine is free again afterwards."""
    import httpx

    from jaxserve.async_engine.engine import AsyncEngine
    from jaxserve.server.app import build_app
    from tests.server.helpers import serve_in_thread

    app = build_app(AsyncEngine(engine), served_model_names=served_model_names)
    answers = {}
    with serve_in_thread(app) as url:
        for line in lines:
            response = httpx.post(url + line["url"], json={**sampling, **line["body"]}, timeout=300)
            answers[line["custom_id"]] = (response.status_code, comparable_body(response.json()))
    return answers
