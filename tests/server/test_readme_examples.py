"""The curl and openai-SDK examples of the README and of docs/serving.md, run as written against the real server.

Two things change: the address (the test server listens on a free port, not 8000) and the API key (the test
server requires one; the README's server does not)."""

import json
import re
import shlex
from pathlib import Path

import httpx

from tests.server.helpers import API_KEY

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
SERVING = ROOT / "docs" / "serving.md"


def code_blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), re.S)


def run_openai_example(page: Path, url: str, capsys) -> str:
    block = next(b for b in code_blocks(page, "python") if "from openai import OpenAI" in b)
    code = block.replace("http://127.0.0.1:8000", url).replace('api_key="EMPTY"', f'api_key="{API_KEY}"')
    exec(compile(code, str(page), "exec"), {})
    return capsys.readouterr().out


def test_readme_curl_example(real_server):
    block = next(b for b in code_blocks(README, "bash") if b.lstrip().startswith("curl"))
    words = shlex.split(block.replace("\\\n", " "))
    url = words[1].replace("http://127.0.0.1:8000", real_server.url)
    body = json.loads(words[words.index("-d") + 1])
    response = httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] and choice["finish_reason"] in ("stop", "length")


def test_readme_openai_sdk_example(real_server, capsys):
    printed = run_openai_example(README, real_server.url, capsys)
    assert len(printed.strip().splitlines()) >= 2  # the chat reply, then the streamed completion


def test_serving_page_openai_sdk_example(real_server, capsys):
    printed = run_openai_example(SERVING, real_server.url, capsys)
    assert len(printed.strip()) > 10
    place = json.loads(printed.strip().splitlines()[-1])  # the structured output example's JSON line
    assert set(place) == {"city", "country"}
