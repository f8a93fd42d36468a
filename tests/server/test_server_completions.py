"""Acceptance: /v1/completions on the real server with SmolLM2, through the openai SDK and httpx."""

import httpx

from tests.server.helpers import API_KEY, REAL_MODEL

PROMPT = "The three primary colors are"


def completion(client, **kwargs):
    kwargs.setdefault("model", REAL_MODEL)
    kwargs.setdefault("prompt", PROMPT)
    kwargs.setdefault("max_tokens", 8)
    return client.completions.create(**kwargs)


def test_greedy_streamed_text_equals_whole_text(openai_client):
    whole = completion(openai_client, temperature=0)
    chunks = list(completion(openai_client, temperature=0, stream=True))
    streamed = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert whole.choices[0].text and streamed == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.model == REAL_MODEL and whole.id.startswith("cmpl-")


def test_usage_counts_match_the_tokenizer(openai_client, tokenizer, real_server):
    result = completion(openai_client, temperature=0, extra_body={"ignore_eos": True})
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == 8 and result.choices[0].finish_reason == "length"
    assert result.usage.total_tokens == len(prompt_ids) + 8
    counted = httpx.post(f"{real_server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert counted["tokens"] == prompt_ids and counted["max_model_len"] == 512


def test_stream_usage_chunk(openai_client):
    chunks = list(completion(openai_client, temperature=0, stream=True, stream_options={"include_usage": True},
                             extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_prompt_tokens_details_count_the_cached_prefix(openai_client):
    """--enable-prompt-tokens-details (the real server has it): a prompt sent again finds its full blocks in the
    prefix cache (16 tokens each here), in the whole response and in the stream's usage chunk."""
    prompt = "Prefix caching keeps the KV of earlier prompts. " * 6
    first = completion(openai_client, prompt=prompt, max_tokens=1)
    again = completion(openai_client, prompt=prompt, max_tokens=1)
    streamed = list(completion(openai_client, prompt=prompt, max_tokens=1, stream=True,
                               stream_options={"include_usage": True}))
    full_blocks = first.usage.prompt_tokens // 16 * 16
    assert first.usage.prompt_tokens_details.cached_tokens < full_blocks
    assert again.usage.prompt_tokens_details.cached_tokens >= full_blocks - 16 > 0
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


def test_cache_salt_keeps_the_prefix_cache_apart(openai_client, real_server):
    """vLLM's cache_salt: a prompt cached under one salt (or none) is found again only under the same salt, in
    chat too; an empty salt or one with beam search is a 400 naming the field."""
    prompt = "A salted prefix stays with the tenant that salted it. " * 6

    def cached(salt=None, **kwargs):
        body = {} if salt is None else {"cache_salt": salt}
        return completion(openai_client, prompt=prompt, max_tokens=1, extra_body=body,
                          **kwargs).usage.prompt_tokens_details.cached_tokens

    assert cached() == 0 and cached() > 0
    assert cached("tenant-a") == 0 and cached("tenant-b") == 0
    assert cached("tenant-a") > 0 and cached("tenant-b") > 0

    def chat_cached(salt=None):
        return openai_client.chat.completions.create(
            model=REAL_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1,
            extra_body={} if salt is None else {"cache_salt": salt}).usage.prompt_tokens_details.cached_tokens

    chat_cached()
    assert chat_cached() > 0 and chat_cached("tenant-c") == 0
    for body in ({"cache_salt": ""}, {"cache_salt": "x", "use_beam_search": True, "n": 2}):
        refused = httpx.post(f"{real_server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                             json={"model": REAL_MODEL, "prompt": "x", "max_tokens": 1, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt", refused.text


def test_prompt_logprobs_in_vllms_format(real_server, tokenizer):
    """vLLM's prompt_logprobs: per prompt token None (the first), else {token id: {logprob, rank, decoded_token}}
    holding the prompt's own token and the top alternatives; the same values echo's logprobs give."""
    def post(path, body):
        return httpx.post(f"{real_server.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                          json={"model": REAL_MODEL, "max_tokens": 1, **body})

    choice = post("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "echo": True, "logprobs": 1}) \
        .json()["choices"][0]
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    positions = choice["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    for token_id, position in zip(prompt_ids[1:], positions[1:]):
        assert str(token_id) in position and 2 <= len(position) <= 3
        assert sorted(entry["rank"] for entry in position.values())[:2] == [1, 2]
        assert position[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
    echoed = choice["logprobs"]["token_logprobs"][1:len(prompt_ids)]
    assert [position[str(t)]["logprob"] for t, position in zip(prompt_ids[1:], positions[1:])] == echoed
    plain = post("/v1/completions", {"prompt": PROMPT}).json()["choices"][0]
    assert plain["prompt_logprobs"] is None
    chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "prompt_logprobs": 0})
    body = chat.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(position) == 1 for position in body["prompt_logprobs"][1:])  # the prompt's own token only
    streamed = post("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_same_seed_gives_same_text(openai_client):
    first = completion(openai_client, temperature=1.0, seed=1234)
    second = completion(openai_client, temperature=1.0, seed=1234)
    assert first.choices[0].text == second.choices[0].text


def test_n_choices(openai_client):
    result = completion(openai_client, n=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [choice.index for choice in result.choices] == [0, 1, 2]
    assert result.usage.completion_tokens == 24
    assert len({choice.text for choice in result.choices}) > 1  # distinct samples, not one copied


def test_echo_with_logprobs(openai_client, tokenizer):
    result = completion(openai_client, temperature=0, echo=True, logprobs=3, max_tokens=4)
    choice = result.choices[0]
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    num_prompt = len(tokenizer(PROMPT)["input_ids"])
    assert len(logprobs.tokens) == num_prompt + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    # Greedy: every generated token is the most likely one.
    for lp, top in list(zip(logprobs.token_logprobs, logprobs.top_logprobs))[num_prompt:]:
        assert abs(lp - max(top.values())) < 1e-4


def test_stop_string_cuts_the_text(openai_client):
    free = completion(openai_client, temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    stopped = completion(openai_client, temperature=0, max_tokens=16, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_token_id_and_batched_prompts(openai_client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    by_ids = completion(openai_client, prompt=ids, temperature=0)
    by_text = completion(openai_client, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = completion(openai_client, prompt=[PROMPT, "Once upon a time"], temperature=0, max_tokens=4)
    assert [choice.index for choice in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text[: len(batch.choices[0].text)]


def test_raw_sse_format(real_server):
    body = {"model": REAL_MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{real_server.url}/v1/completions", json=body, headers=headers,
                      timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(event.startswith("data: {") for event in events[:-1])


def test_truncate_prompt_tokens_keeps_the_prompts_end(openai_client, tokenizer):
    """vLLM's truncate_prompt_tokens: the completion of the last k tokens, counted and echoed as k tokens."""
    ids = tokenizer(PROMPT)["input_ids"]
    kept = completion(openai_client, prompt=ids[-3:], temperature=0)
    truncated = completion(openai_client, temperature=0, echo=True, extra_body={"truncate_prompt_tokens": 3})
    assert truncated.usage.prompt_tokens == 3
    assert truncated.choices[0].text == tokenizer.decode(ids[-3:]) + kept.choices[0].text
