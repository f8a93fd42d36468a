"""What the layers above an Engine use of it: `StepEngine`. AsyncEngine steps it on a thread of its own, the
server and batch jobs prepare requests with it; the test suite's scripted engine (tests/server/fake_engine.py)
implements the same Protocol, and a test holds both to it, so the fake cannot drift from the real surface."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class StepEngine(Protocol):
    tokenizer: Any  # a transformers tokenizer, with the chat template served
    model_name: str
    generation_defaults: dict  # sampling defaults from the model's generation_config.json and the overrides
    config: Any  # EngineConfig: the model's and the cache's and scheduler's settings
    head: Any  # loader.heads.ModelHead: generates, embeds or classifies
    adapters: Any  # EngineAdapters: `preloaded`, the LoRA adapters served by name

    @property
    def max_model_len(self) -> int: ...

    def eos_token_ids(self) -> tuple[int, ...]: ...

    def prepare_request(self, request_id: str, prompt, params, *, priority: int = 0, lora_request=None):
        """Tokenize and validate, no device work (any thread); ValueError for bad input."""

    def add_prepared_request(self, request) -> None: ...

    def add_request(self, request_id: str, prompt, params, *, priority: int = 0, lora_request=None) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work left: an unfinished request or a launched step not yet read back."""

    def step(self, finished_only: bool = False) -> list:
        """One step; the outputs of the requests it advanced (the engine thread only)."""

    def stats(self) -> dict: ...

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **rendering) -> list[int]: ...

    def prepare_beam_search(self, prompt, params): ...

    def add_lora(self, lora_request, load_inplace: bool = False): ...

    def remove_lora(self, lora) -> bool: ...

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, lora_request=None,
                 priority=None) -> list: ...
