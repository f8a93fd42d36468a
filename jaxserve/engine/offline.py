"""The synchronous Python API (vLLM's `LLM`): `generate`, `embed`, `classify`, `score`, `chat`, `stream`, built on the
engine's request and step methods (`prepare_request`, `add_prepared_request`, `add_request`, `step`,
`abort_request`), which the Engine class provides; kept apart from the step machinery in engine.py."""

from __future__ import annotations

from collections.abc import Iterator

from jaxserve.core.scoring import as_prompts, check_cross_encoder, cross_encoder_prompts, pair_scores, score_pairs
from jaxserve.engine.inputs import normalise_conversations, normalise_prompts
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams


class OfflineAPI:
    """Mixed into Engine. Needs: tokenizer, generation_defaults, head, _request_ids (a counter), prepare_request,
    add_prepared_request, add_request, step, abort_request."""

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts (a str, a list of str, or a list of token-id lists) to completion, in input order;
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (vLLM's `LLM.generate`)."""
        prompts = normalise_prompts(prompts)
        return self._run_all(prompts, params, use_tqdm, lora_request)

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

    def score(self, text_1, text_2, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """Score text pairs (vLLM's `LLM.score`): one `text_1` against each of `text_2`, or the two lists pairwise;
        a text may be a str or token ids. An embedding model scores the cosine similarity of the two embeddings; a
        cross-encoder (a classifier with one label) reads each pair as one prompt and scores its relevance."""
        first, second = as_prompts(text_1), as_prompts(text_2)
        pairs = score_pairs(len(first), len(second))
        if self.head.classifier is None:  # each text embedded; a pair's prompts are its two texts'
            outs = self.embed(first + second, PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens),
                              use_tqdm=use_tqdm, lora_request=lora_request)
            prompt_ids = [outs[i].prompt_token_ids + outs[len(first) + j].prompt_token_ids for i, j in pairs]
        else:  # a cross-encoder: one prompt a pair
            check_cross_encoder(self.head.classifier)
            prompts = cross_encoder_prompts(self.tokenizer, first, second, pairs, truncate_prompt_tokens,
                                            self.max_model_len)
            outs = self.classify(prompts, use_tqdm=use_tqdm, lora_request=lora_request)
            prompt_ids = [out.prompt_token_ids for out in outs]
        return [ScoringRequestOutput(f"score-{next(self._request_ids)}", ScoringOutput(score), ids)
                for score, ids in zip(pair_scores(outs, len(first), pairs), prompt_ids)]

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of conversations; the template
        options are vLLM's `LLM.chat` ones."""
        prompts = [self.encode_chat(conv, add_generation_prompt, continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs, tools=tools)
                   for conv in normalise_conversations(messages)]
        return self._run_all(prompts, params, use_tqdm, lora_request)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **rendering) -> list[int]:
        """Token ids of the messages through the chat template; `rendering`: continue_final_message,
        chat_template_kwargs, tools (loader/tokenizer.apply_chat_template)."""
        from jaxserve.loader.tokenizer import apply_chat_template

        return apply_chat_template(self.tokenizer, messages, add_generation_prompt,
                                   content_format=self.chat_content_format, **rendering)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that advanced it, until it finishes. A caller that stops
        reading (break, close) aborts the request: its KV blocks are freed, no later step runs it."""
        request_id = f"stream-{next(self._request_ids)}"
        self.add_request(request_id, prompt, params or self.default_sampling_params())
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.abort_request(request_id)

    def _run_all(self, prompts: list, params, use_tqdm: bool, lora_request=None) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        params_list = params if isinstance(params, list) else [params or self.default_sampling_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} params for {len(prompts)} prompts; give one or one each")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; give one or one each")
        ids = [f"gen-{next(self._request_ids)}" for _ in prompts]
        # Validate every prompt before anything runs, so one bad prompt does not leave the others half done.
        requests = [self.prepare_request(rid, prompt, p, lora_request=lora)
                    for rid, prompt, p, lora in zip(ids, prompts, params_list, loras)]
        for request in requests:
            self.add_prepared_request(request)
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        try:
            with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as bar:
                while len(results) < len(ids):
                    for out in self.step(finished_only=True):
                        if out.request_id in wanted:  # not a request left over from an interrupted call
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:  # an interrupt or an error: these requests must not run on inside later calls
            for rid in ids:
                self.abort_request(rid)
            raise
        return [results[rid] for rid in ids]

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, ...), as vLLM. Its
        max_new_tokens leaves max_tokens None, which a request fills with the room in the context up to that cap."""
        defaults = self.generation_defaults
        return SamplingParams(**{**defaults, "max_tokens": None} if "max_tokens" in defaults else defaults)
