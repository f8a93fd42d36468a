"""BeamSearchParams: what a beam search asks for (vLLM's class, with transformers' `early_stopping`); the search
itself is beam_search.py. Host-only and light, like sampling_params.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxserve.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, with transformers' `early_stopping`. The search is deterministic: beams are
    ranked by the model's own logprobs (no temperature, penalties or sampling)."""

    beam_width: int
    max_tokens: int | None = 16  # None: up to the context length
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True: stop once beam_width hypotheses finished; "never": the exact bound
    temperature: float = 0.0  # vLLM's signature; as there, beams are ranked by the raw logprobs whatever it is
    include_stop_str_in_output: bool = False  # vLLM's signature; EOS is the only stop
    skip_special_tokens: bool = True

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    constrained = False  # no grammar applies (asked as of SamplingParams by the servers' reasoning parsers)

    def candidates_per_beam(self, num_eos_ids: int) -> int:
        """How many continuations a round keeps (transformers' `beams_to_keep`): enough that beam_width live ones
        remain even if every EOS token is among the best."""
        return max(2, 1 + (0 if self.ignore_eos else num_eos_ids)) * self.beam_width

    def step_params(self, num_eos_ids: int) -> SamplingParams:
        """One round's request for one beam: a single greedy token and the top logprobs the round ranks."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.candidates_per_beam(num_eos_ids),
                              ignore_eos=True, skip_special_tokens=self.skip_special_tokens)


def check_beam_width(params: BeamSearchParams, eos_token_ids: tuple[int, ...], max_logprobs: int) -> None:
    """Each round ranks the top `candidates_per_beam` logprobs of every beam, which the engine must return."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    needed = params.candidates_per_beam(len(eos_token_ids))
    if needed > max_logprobs:
        raise ValueError(f"beam_width={params.beam_width} ranks {needed} logprobs per beam, above the engine's "
                         f"max_logprobs={max_logprobs}: lower beam_width or start the engine with max_logprobs "
                         f">= {needed}")
