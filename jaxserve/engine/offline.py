"""The synchronous Python API (vLLM's `LLM`): `generate`, `embed`, `classify`, `encode`, `score`, `chat`, `stream`,
`beam_search`, a facade over any StepEngine's request and step methods (engine/interface.py); the Engine offers
it as its own methods. Beam search runs every prompt's round of one-token requests as one batch
(core/beam_search.py holds the search itself; async_engine/beam_search_stream.py runs it for the servers)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from jaxserve.core.beam_search import BeamSearchOutput, top_logprobs_of
from jaxserve.core.scoring import check_cross_encoder, cross_encoder_prompts, pair_scores, score_pairs
from jaxserve.engine.inputs import InputProcessor, normalise_conversations, normalise_prompts
from jaxserve.engine.interface import StepEngine
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxserve.pooling_params import TASKS, PoolingParams
from jaxserve.sampling_params import BeamSearchParams, SamplingParams


class OfflineAPI:
    """Runs whole calls on `engine` (a StepEngine) by stepping it until their requests finish; `inputs` (the
    engine's InputProcessor) gives chat prompts, beam searches and default sampling parameters."""

    def __init__(self, engine: StepEngine, inputs: InputProcessor):
        self._engine = engine
        self._inputs = inputs
        self._request_ids = itertools.count()  # this API's own request ids: gen-N, stream-N, score-N

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Run prompts (a str, a list of str, or a list of token-id lists) to completion, in input order;
        `lora_request`: the LoRA adapter of every prompt, or one per prompt; `priority`: one per prompt, a lower
        one scheduled first (vLLM's `LLM.generate`)."""
        prompts = normalise_prompts(prompts)
        return self._run_all(prompts, params, use_tqdm, lora_request, priority)

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
              use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """Embed prompts (as `generate` takes them), in input order: `output.outputs.embedding` is the final hidden
        state at the prompt's last token, normalized unless `PoolingParams(normalize=False)` (vLLM's `LLM.embed`)."""
        return self._run_all(normalise_prompts(prompts), pooling_params or PoolingParams(), use_tqdm, lora_request)

    def classify(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """The class probabilities a sequence classifier gives each prompt, in input order (vLLM's
        `LLM.classify`): `output.outputs.probs`, and `.label`, the most probable class's."""
        params = PoolingParams(task="classify", truncate_prompt_tokens=truncate_prompt_tokens)
        return self._run_all(normalise_prompts(prompts), params, use_tqdm, lora_request)

    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
               use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
               pooling_task: str | None = None) -> list[EmbeddingRequestOutput | ClassificationRequestOutput]:
        """vLLM's `LLM.encode`: pooling with the task named (`"embed"` as `embed`, `"classify"` as `classify`),
        which replaces the task of the pooling parameters given. vLLM's per-token tasks (`token_embed`,
        `token_classify`) pool every token, which no model here has a head for: refused, as is no task at all."""
        if pooling_task not in TASKS:
            tasks = " or ".join(map(repr, TASKS))
            raise ValueError(f"pooling_task must be {tasks} (got {pooling_task!r}); Engine.embed and "
                             f"Engine.classify are the same calls by name")
        if isinstance(pooling_params, list):
            params = [dataclasses.replace(p, task=pooling_task) for p in pooling_params]
        else:
            params = dataclasses.replace(pooling_params or PoolingParams(), task=pooling_task)
        return self._run_all(normalise_prompts(prompts), params, use_tqdm, lora_request)

    def score(self, text_1, text_2, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """Score text pairs (vLLM's `LLM.score`): one `text_1` against each of `text_2`, or the two lists pairwise;
        a text may be a str or token ids. An embedding model scores the cosine similarity of the two embeddings; a
        cross-encoder (a classifier with one label) reads each pair as one prompt and scores its relevance."""
        first, second = normalise_prompts(text_1), normalise_prompts(text_2)  # token ids in any form generate takes
        pairs = score_pairs(len(first), len(second))
        if self._engine.head.classifier is None:  # each text embedded; a pair's prompts are its two texts'
            outs = self.embed(first + second, PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens),
                              use_tqdm=use_tqdm, lora_request=lora_request)
            prompt_ids = [outs[i].prompt_token_ids + outs[len(first) + j].prompt_token_ids for i, j in pairs]
        else:  # a cross-encoder: one prompt a pair
            check_cross_encoder(self._engine.head.classifier)
            prompts = cross_encoder_prompts(self._engine.tokenizer, first, second, pairs, truncate_prompt_tokens,
                                            self._engine.max_model_len, self._engine.head.classifier.pair_encoding)
            outs = self.classify(prompts, use_tqdm=use_tqdm, lora_request=lora_request)
            prompt_ids = [out.prompt_token_ids for out in outs]
        return [ScoringRequestOutput(f"score-{next(self._request_ids)}", ScoringOutput(score), ids)
                for score, ids in zip(pair_scores(outs, len(first), pairs), prompt_ids)]

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None, chat_template: str | None = None,
             chat_template_content_format: str | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of conversations; the template
        options are vLLM's `LLM.chat` ones (`chat_template`: Jinja text rendering these instead of the engine's;
        `chat_template_content_format`: auto, string or openai, instead of the engine's)."""
        rendering = dict(continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                         tools=tools, chat_template=chat_template)
        if chat_template_content_format is not None:
            rendering["content_format"] = chat_template_content_format
        prompts = [self._inputs.encode_chat(conv, add_generation_prompt, **rendering)
                   for conv in normalise_conversations(messages)]
        return self._run_all(prompts, params, use_tqdm, lora_request)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that advanced it, until it finishes. A caller that stops
        reading (break, close) aborts the request: its KV blocks are freed, no later step runs it."""
        request_id = f"stream-{next(self._request_ids)}"
        self._engine.add_request(request_id, prompt, params or self._inputs.default_sampling_params())
        finished = False
        try:
            while not finished:
                for out in self._engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self._engine.abort_request(request_id)

    def _run_all(self, prompts: list, params, use_tqdm: bool, lora_request=None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        one = params is None or isinstance(params, (SamplingParams, PoolingParams))
        params_list = [params or self._inputs.default_sampling_params()] * len(prompts) if one else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} params for {len(prompts)} prompts; give one or one each")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; give one or one each")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts; give one each")
        ids = [f"gen-{next(self._request_ids)}" for _ in prompts]
        # Validate every prompt before anything runs, so one bad prompt does not leave the others half done.
        requests = [self._engine.prepare_request(rid, prompt, p, lora_request=lora, priority=rank)
                    for rid, prompt, p, lora, rank in zip(ids, prompts, params_list, loras, priorities)]
        for request in requests:
            self._engine.add_prepared_request(request)
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        try:
            with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as bar:
                while len(results) < len(ids):
                    for out in self._engine.step(finished_only=True):
                        if out.request_id in wanted:  # not a request left over from an interrupted call
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:  # an interrupt or an error: these requests must not run on inside later calls
            for rid in ids:
                self._engine.abort_request(rid)
            raise
        return [results[rid] for rid in ids]

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = True,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """The best `params.beam_width` sequences of each prompt (prompts as `generate` takes them), in input
        order (vLLM's `LLM.beam_search`)."""
        from tqdm.auto import tqdm

        prompts = normalise_prompts(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; give one or one each")
        searches = [self._inputs.prepare_beam_search(prompt, params) for prompt in prompts]  # all checked before any runs
        round_params = searches[0].round_params  # the same for every search: they share params
        with tqdm(total=max(s.max_new_tokens for s in searches), desc="Beam search", disable=not use_tqdm) as bar:
            while live := [(search, lora) for search, lora in zip(searches, loras) if not search.done]:
                beams = [(prompt, lora) for search, lora in live for prompt in search.prompts()]
                outputs = self._run_all([prompt for prompt, _ in beams], round_params, use_tqdm=False,
                                        lora_request=[lora for _, lora in beams])
                start = 0
                for search, _ in live:
                    end = start + len(search.running)
                    search.advance([top_logprobs_of(output) for output in outputs[start:end]])
                    start = end
                bar.update(1)
        return [search.result(self._engine.tokenizer) for search in searches]
