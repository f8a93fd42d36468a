"""Beam search on the Engine (vLLM's `LLM.beam_search`): every prompt's round of one-token requests runs as one
batch (core/beam_search.py holds the search itself; async_engine/beam_search_stream.py runs it for the servers)."""

from __future__ import annotations

import dataclasses

from jaxserve.core.beam_search import BeamSearch, BeamSearchOutput, top_logprobs_of
from jaxserve.engine.inputs import normalise_prompts, prompt_token_ids, split_prompt, validate_lengths
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import BeamSearchParams, SamplingParams, check_beam_width


class BeamSearchAPI:
    """Mixed into Engine. Needs: tokenizer, config, max_model_len, eos_token_ids, _run_all."""

    def prepare_beam_search(self, prompt: str | list[int] | dict, params: BeamSearchParams) -> BeamSearch:
        """Tokenize and validate one prompt's search (no device work, safe from any thread): a ValueError for a
        beam too wide for the engine's logprobs, a bad token id, or beams that cannot fit the context or cache."""
        eos = self.eos_token_ids()
        check_beam_width(params, eos, self.config.max_logprobs)
        prompt, cache_salt = split_prompt(prompt)
        if cache_salt is not None:
            raise ValueError("cache_salt cannot be combined with beam search; leave one out")
        ids = prompt_token_ids(self.tokenizer, prompt, self.config.model.vocab_size)
        # As for a request of beam_width sequences: each beam may grow to prompt + max_tokens.
        checked = validate_lengths(SamplingParams(n=params.beam_width, max_tokens=params.max_tokens), len(ids),
                                   self.max_model_len, self.config, self.generation_defaults.get("max_tokens"))
        return BeamSearch(ids, dataclasses.replace(params, max_tokens=checked.max_tokens), eos, self.max_model_len)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = True,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """The best `params.beam_width` sequences of each prompt (prompts as `generate` takes them), in input
        order (vLLM's `LLM.beam_search`)."""
        from tqdm.auto import tqdm

        prompts = normalise_prompts(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; give one or one each")
        searches = [self.prepare_beam_search(prompt, params) for prompt in prompts]  # all checked before any runs
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
        return [search.result(self.tokenizer) for search in searches]
