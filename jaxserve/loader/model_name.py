"""What a model path is and the name it is served under, read without loading anything (no jax): `jaxserve batch
--validate` checks request bodies' model names with it."""

from __future__ import annotations

from pathlib import Path

from jaxserve.loader.default_model import DEFAULT_MODEL_NAME


def is_gguf_file(path: Path) -> bool:
    """A GGUF file, by its suffix or its first bytes (ollama's blobs have no suffix)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


def served_name(model: str | None) -> str:
    """The name a model is served under unless another is given (--served-model-name): a GGUF file's stem
    (`./SmolLM2.Q4_1.gguf` is `SmolLM2.Q4_1`), the built-in default's name, else the model as given."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.stem if is_gguf_file(path) else model


def check_adapter_names(served_names: list[str], adapter_names) -> None:
    """ValueError when a LoRA adapter is named as the model is served: requests for the model would get the
    adapter, and the model itself could not be asked for."""
    clash = sorted(set(served_names) & set(adapter_names))
    if clash:
        raise ValueError(f"the LoRA adapter {clash[0]!r} has the served model's name; give the adapter another name "
                         "(--lora-modules NAME=PATH) or serve the model under another (--served-model-name)")
