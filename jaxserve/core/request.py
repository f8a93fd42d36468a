"""Host-side request state. A request asks for `n` (or `best_of`) samples; each is one `Sequence`."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from functools import cached_property

from ..lora_request import LoRARequest
from ..sampling_params import SamplingParams

PLACEHOLDER = -1  # a sampled token id not read back yet (async scheduling); never an input id on the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's samples this is
    token_ids: list[int]  # prompt followed by the tokens generated so far
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # the sequence's own random stream: 32 bits (engine/inputs.sequence_seed, or random)
    arrival: int  # admission order, for first-come-first-served
    priority: int = 0  # lower runs first (vLLM's convention)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_preemptions: int = 0  # times its blocks were taken back and it went back to waiting
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)  # per generated token, when asked
    prompt_logprobs: list = field(default_factory=list)  # per prompt position, when asked
    # With async scheduling a step is dispatched before the previous one's tokens are read back: the sequence's
    # token sampled by the step in flight is then PLACEHOLDER at `pending_index` in token_ids, and the next step
    # takes its value on the device from row `pending_row` of the in-flight step's sampled tokens.
    pending_index: int | None = None
    pending_row: int | None = None
    # On a pipeline whose stages stay busy across steps, a step planned with this sequence's sampling chunk is
    # still in a stage that is not the last: its next token is not sampled yet, so no later step may take it.
    staged: bool = False
    # Structured outputs: the llguidance matcher that has consumed this sequence's output so far (grammar.py),
    # and, for a grammar that starts after a token (reasoning), that token until it is sampled.
    matcher: object | None = None
    grammar_waits_for: int | None = None
    # vLLM's allowed_token_ids as a grammar-style bitmask, and its bad_words as token sequences (core/token_rules.py).
    allowed_mask: object | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    # The LoRA adapter it runs with (None: the base model), and the device slot holding it once admitted (-1:
    # none yet; core/adapter_slots.py).
    lora_request: LoRARequest | None = None
    lora_slot: int = -1
    # A pooling request (PoolingParams: embed, classify) ends at its prompt's last token: its embedding or class
    # probabilities are taken from the hidden state there, and no token is generated.
    pooling: object | None = None
    pooled: list[float] | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks

    @cached_property  # read at every step
    def cache_root(self) -> bytes:
        """The root of its blocks' prefix-cache hash chain: the adapter's, so KV never matches across adapters,
        salted, so that one tenant's requests cannot tell from timings which prompts another has sent."""
        adapter = b"" if self.lora_request is None else self.lora_request.cache_root
        if self.cache_salt is None:
            return adapter
        return hashlib.sha256(b"salt\0" + self.cache_salt.encode() + b"\0" + adapter).digest()

    @property
    def grammar_active(self) -> bool:
        """Whether the next token must fit the grammar."""
        return self.matcher is not None and self.grammar_waits_for is None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens known on the host (without a placeholder still in flight)."""
        return self.token_ids[self.num_prompt_tokens : self.pending_index]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, a placeholder in flight included (the count the next step's sampling sees)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def stop_after(self, token: int, index: int) -> tuple[str, int | None] | None:
        """The finish reason (and stop token) once `token` is in place at `index` of token_ids, or None to go on.
        `index` is explicit because a later token may already be in flight after it."""
        p = self.params
        n_out = index + 1 - self.num_prompt_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
        if self.reaches_length_limit(index + 1):
            return "length", None
        return None

    def reaches_length_limit(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens tokens has used up max_tokens or the context length."""
        p = self.params
        return (p.max_tokens is not None and num_tokens - self.num_prompt_tokens >= p.max_tokens) or \
            num_tokens >= self.max_model_len


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    sequences: list[Sequence]
    params: SamplingParams
    pooling: object | None = None  # PoolingParams: a pooling request (one sequence)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)
