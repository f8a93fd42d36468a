"""The pooling a sentence-transformers checkpoint declares: `modules.json` names its Pooling module, whose
`config.json` sets one `pooling_mode_*` flag. jaxserve embeds by the last token; the engine refuses embedding
requests for a model that declares another pooling rather than answer with vectors it was not trained to give."""

from __future__ import annotations

import json
from pathlib import Path

MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
         "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
         "pooling_mode_weightedmean_tokens": "weightedmean"}


def declared_pooling(directory: Path) -> str | None:
    """"lasttoken", "mean", "cls", ... (joined by "+" if several), or None where the checkpoint declares none."""
    modules_path = directory / "modules.json"
    if not modules_path.is_file():
        return None
    for module in _read(modules_path) or []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("models.Pooling"):
            config = _read(directory / str(module.get("path", "")) / "config.json")
            modes = [name for key, name in MODES.items() if isinstance(config, dict) and config.get(key)]
            return "+".join(modes) or None
    return None


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # a sentence-transformers extra, not what serves the model: unreadable is "none"
        return None
