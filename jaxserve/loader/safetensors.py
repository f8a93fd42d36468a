"""Tensors of a Hugging Face checkpoint directory: one `model.safetensors` or shards with an index."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

# safetensors' names of the float8 dtypes, read by hand (SafetensorsSource._read_float8)
FLOAT8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


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
        dtype = self._read_handle(name).get_slice(name).get_dtype()
        if dtype in FLOAT8_DTYPES:  # safetensors' flax reader asks numpy for float8, which numpy lacks
            return self._read_float8(name, FLOAT8_DTYPES[dtype])
        return self._read(name, lambda handle: handle.get_tensor(name))

    def _read_float8(self, name: str, dtype) -> np.ndarray:
        """A float8 tensor straight from the file: an 8-byte header length, the JSON header, then the data."""
        with open(self._file_of[name], "rb") as f:
            header_bytes = struct.unpack("<Q", f.read(8))[0]
            entry = json.loads(f.read(header_bytes))[name]
            start, end = entry["data_offsets"]
            f.seek(8 + header_bytes + start)
            data = f.read(end - start)
        return np.frombuffer(data, dtype).reshape(entry["shape"])

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
