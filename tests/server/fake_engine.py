"""A deterministic stand-in for `jaxserve.engine.Engine`: the same surface (the StepEngine Protocol,
jaxserve/engine/interface.py, which tests/engine/test_interface.py holds both to) and a real tokenizer.

It makes the server and AsyncEngine testable in milliseconds: no model, no compilation. Each generated token is
taken from a fixed script, so texts are predictable; seeds and output indices shift where in the script a
sequence starts, so "same seed, same text" and "n distinct samples" hold as with a real sampler.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from jaxserve.core.beam_search import BeamSearch
from jaxserve.errors import InvalidRequestField
from jaxserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingRequestOutput,
    RequestOutput,
)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams, check_beam_width

SCRIPT_TEXT = " one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"


@dataclass
class FakeRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    offsets: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class FakeEngine:
    def __init__(self, tokenizer, *, max_model_len=256, total_blocks=64, block_size=16, max_logprobs=20,
                 step_delay=0.002, script_text=SCRIPT_TEXT, ends_with_script=False):
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.generation_defaults: dict = {}  # a model whose generation_config.json sets no sampling defaults
        self.config = SimpleNamespace(cache=SimpleNamespace(block_size=block_size), dtype="float32")
        self.max_model_len = max_model_len
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.max_logprobs = max_logprobs
        self.step_delay = step_delay
        self.fail_next_step = False  # tests set this to simulate a device failure
        self.step_started = threading.Event()  # set on every step, so tests can wait for progress
        self._script = tokenizer.encode(script_text)
        self.ends_with_script = ends_with_script  # the script's last token finishes "stop", as an EOS would
        self._running: dict[str, FakeRequest] = {}
        self.aborted: list[str] = []
        self.adapters = SimpleNamespace(preloaded={})  # the LoRA adapters served by name (serve --lora-modules)
        self.head = SimpleNamespace(generates=True, classifier=None)  # a causal LM (loader/heads.ModelHead)
        self.lora_requests: dict[str, object] = {}  # request id -> the adapter it was prepared with
        self.prompts: dict[str, object] = {}  # request id -> the prompt and params it was prepared with
        self.sampling_params: dict[str, object] = {}
        self.removed_loras: list[str] = []  # remove_lora calls, in order
        self.replaced_loras: list[str] = []  # add_lora calls with load_inplace, in order
        self.loaded_loras: dict[str, str] = {}  # name -> path, as the engine keeps names (engine/adapters.py)

    def eos_token_ids(self):
        return (self.tokenizer.eos_token_id,)

    def prepare_beam_search(self, prompt, params):
        """As the engine: the width and lengths checked as for a request of beam_width sequences."""
        check_beam_width(params, self.eos_token_ids(), self.max_logprobs)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self._fitted_max_tokens(len(ids), params.max_tokens)
        return BeamSearch(ids, dataclasses.replace(params, max_tokens=max_tokens), self.eos_token_ids(),
                          self.max_model_len)

    def _fitted_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        """As the engine: a prompt the context cannot hold, or max_tokens beyond it, is refused; max_tokens beyond
        the room the prompt leaves is cut to it."""
        if prompt_len >= self.max_model_len:
            raise ValueError(f"the prompt has {prompt_len} tokens but the model's maximum context length is "
                             f"{self.max_model_len}")
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise InvalidRequestField(f"max_tokens={max_tokens} is more than the model's maximum context length of "
                                      f"{self.max_model_len} tokens", "max_tokens")
        return min(max_tokens or self.max_model_len, self.max_model_len - prompt_len)

    def add_lora(self, lora_request, load_inplace=False):
        """As the engine: a directory it cannot serve is a ValueError naming why."""
        if not os.path.isfile(os.path.join(lora_request.lora_path, "adapter_config.json")):
            raise ValueError(f"{lora_request.lora_path} has no adapter_config.json")
        known = self.loaded_loras.get(lora_request.lora_name)
        if known is not None and known != lora_request.lora_path and not load_inplace:
            raise ValueError(f"adapter name {lora_request.lora_name!r} is already in use for {known}")
        self.loaded_loras[lora_request.lora_name] = lora_request.lora_path
        self.replaced_loras += [lora_request.lora_name] if load_inplace else []
        return lora_request

    def remove_lora(self, lora):
        self.removed_loras.append(lora)
        return self.loaded_loras.pop(lora, None) is not None

    def prepare_request(self, request_id, prompt, params, *, priority=0, lora_request=None):
        self.lora_requests[request_id] = lora_request
        self.prompts[request_id], self.sampling_params[request_id] = prompt, params
        if isinstance(prompt, dict):  # vLLM's prompt dict (a cache_salt given): the salt changes no output here
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(params, PoolingParams):  # an embedding: the prompt's token count, then zeros
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if params.task == "classify":  # one class, certain
                return ClassificationRequestOutput(request_id, ClassificationOutput([1.0], "LABEL_0"), token_ids)
            vector = [float(len(token_ids))] + [0.0] * ((params.dimensions or 8) - 1)
            return EmbeddingRequestOutput(request_id, EmbeddingOutput(vector), token_ids)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids, prompt = list(prompt), None
            bad = [t for t in token_ids if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {len(self.tokenizer)})")
        if not token_ids:
            raise ValueError("the prompt is empty")
        max_tokens = self._fitted_max_tokens(len(token_ids), params.max_tokens)
        if max_tokens != params.max_tokens:
            params = params.replace(max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}={value} is above the maximum of {self.max_logprobs}")
        if params.num_sequences * (len(token_ids) + 1) > self.total_blocks * self.block_size:
            raise ValueError("n x (prompt + 1) is more than the whole KV cache holds")  # as the engine
        return FakeRequest(request_id, prompt, token_ids, params, self._start_offsets(params))

    def _start_offsets(self, params):
        if params.greedy:
            return [0] * params.n
        rng = random.Random(params.seed)
        return [rng.randrange(len(self._script)) for _ in range(params.n)]

    def add_prepared_request(self, request):
        if isinstance(request, PoolingRequestOutput):
            self._running[request.request_id] = request
            return
        request.outputs = [CompletionOutput(index=i, text="", token_ids=[],
                                            logprobs=[] if request.params.logprobs is not None else None)
                           for i in range(request.params.n)]
        self._running[request.request_id] = request

    def add_request(self, request_id, prompt, params, *, priority=0, lora_request=None):
        self.add_prepared_request(self.prepare_request(request_id, prompt, params, priority=priority,
                                                       lora_request=lora_request))

    def abort_request(self, request_id):
        if self._running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self._running)

    def step(self, finished_only=False):
        self.step_started.set()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("simulated device failure")
        time.sleep(self.step_delay)
        results = [self._advance(request) for request in list(self._running.values())]
        for result in results:
            if result.finished:
                del self._running[result.request_id]
        return [result for result in results if result.finished or not finished_only]

    def _advance(self, request):
        if isinstance(request, PoolingRequestOutput):
            return request
        for output in request.outputs:
            if not output.finished:
                self._append_token(request, output)
        finished = all(o.finished for o in request.outputs)
        # Fresh objects each step, as the real engine returns: callers may read them from another thread.
        outputs = [dataclasses.replace(o, token_ids=list(o.token_ids),
                                       logprobs=None if o.logprobs is None else list(o.logprobs))
                   for o in request.outputs]
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids), outputs,
                             finished=finished, prompt_logprobs=self._prompt_logprobs(request))

    def _append_token(self, request, output):
        params = request.params
        position = request.offsets[output.index] + len(output.token_ids)
        token = self._script[position % len(self._script)]
        output.token_ids.append(token)
        if output.logprobs is not None:
            output.logprobs.append(self._position_logprobs(token, params.logprobs))
        output.text = self.tokenizer.decode(output.token_ids)
        for stop in params.stop:
            if stop in output.text:
                cut = output.text.index(stop) + (len(stop) if params.include_stop_str_in_output else 0)
                output.text, output.finish_reason, output.stop_reason = output.text[:cut], "stop", stop
                return
        if self.ends_with_script and position % len(self._script) == len(self._script) - 1:
            output.finish_reason = "stop"
        elif len(output.token_ids) >= (params.max_tokens or self.max_model_len - len(request.prompt_token_ids)):
            output.finish_reason = "length"

    def _position_logprobs(self, token, top_n):
        entries = {token: Logprob(-0.25, 1, self.tokenizer.decode([token]))}
        for rank in range(2, top_n + 2):
            alternative = (token + rank) % len(self.tokenizer)
            entries.setdefault(alternative, Logprob(-float(rank), rank, self.tokenizer.decode([alternative])))
        return entries

    def _prompt_logprobs(self, request):
        if request.params.prompt_logprobs is None:
            return None
        n = request.params.prompt_logprobs
        return [None] + [self._position_logprobs(t, n) for t in request.prompt_token_ids[1:]]

    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None, priority=None):
        params = sampling_params or SamplingParams()
        for index, prompt in enumerate(prompts):
            self.add_request(f"generate-{index}", prompt, params, lora_request=lora_request,
                             priority=priority[index] if priority else 0)
        finals = {}
        while self.has_unfinished_requests():
            finals.update({output.request_id: output for output in self.step() if output.finished})
        return [finals[f"generate-{index}"] for index in range(len(prompts))]

    def encode_chat(self, messages, add_generation_prompt=True, **rendering):
        from jaxserve.loader.tokenizer import apply_chat_template

        # As Engine renders, errors too.
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, **rendering)

    def stats(self):
        used = sum(
            math.ceil((len(r.prompt_token_ids) + max(len(o.token_ids) for o in r.outputs)) / self.block_size)
            for r in self._running.values() if not isinstance(r, PoolingRequestOutput)
        )
        return {"total_blocks": self.total_blocks, "free_blocks": self.total_blocks - used,
                "num_running": len(self._running), "num_waiting": 0, "num_preemptions": 0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "compiles_after_warmup": 0}
