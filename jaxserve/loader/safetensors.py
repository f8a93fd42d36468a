"""Tensors of a Hugging Face checkpoint directory: one `model.safetensors` or shards with an index."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open


class SafetensorsSource:
    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: directory / f for name, f in weight_map.items()}
        else:
            single = directory / "model.safetensors"
            if not single.exists():
                raise FileNotFoundError(
                    f"no model.safetensors or model.safetensors.index.json in {directory}; "
                    "jaxserve loads safetensors checkpoints (convert .bin files with transformers' save_pretrained)"
                )
            with self._open(single) as f:
                self._file_of = {name: single for name in f.keys()}
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _open(path: Path):
        if not path.exists():
            raise FileNotFoundError(f"checkpoint shard {path} is missing; re-download the model")
        try:
            # The "flax" framework reads bfloat16 (numpy cannot); keep the arrays on the host CPU (this process's
            # own: under jax.distributed, jax.local_devices(backend="cpu")[0] may belong to another process).
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                return safe_open(str(path), framework="flax")
        except SafetensorError as e:
            raise ValueError(f"{path} is not a valid safetensors file ({e}); it may be truncated: re-download it") from None

    def names(self) -> set[str]:
        return set(self._file_of)

    def get(self, name: str) -> np.ndarray:
        return self._read(name, lambda handle: handle.get_tensor(name))

    def get_rows(self, name: str, start: int, end: int) -> np.ndarray:
        """Rows start:end of a tensor, reading only those (a fused projection's part, loader/fused.py)."""
        return self._read(name, lambda handle: handle.get_slice(name)[start:end])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._read_handle(name).get_slice(name).get_shape())

    def _read(self, name: str, read) -> np.ndarray:
        handle = self._read_handle(name)
        try:
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                return np.asarray(read(handle))
        except SafetensorError as e:
            raise ValueError(f"cannot read tensor {name!r} from {self._file_of[name]} ({e}); the file may be "
                             f"truncated") from None

    def _read_handle(self, name: str):
        if name not in self._file_of:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = self._open(path)
        return self._handles[path]
