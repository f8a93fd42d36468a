"""The pooling a sentence-transformers checkpoint declares: `modules.json` names its Pooling module, whose
`config.json` sets one `pooling_mode_*` flag (sentence-transformers 6: a `pooling_mode` string), and any Dense
projection after it. jaxserve embeds by the last token's hidden state; the engine refuses embedding requests for
a model that declares another pooling, or a projection, rather than answer with vectors it was not trained to
give. Module types are read by their class name, which sentence-transformers 6 moved to other modules."""

from __future__ import annotations

import json
from pathlib import Path

MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
         "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
         "pooling_mode_weightedmean_tokens": "weightedmean"}


def declared_pooling(directory: Path) -> str | None:
    """"lasttoken", "mean", "cls", ... (joined by "+" if several; ", then a Dense projection" after them where
    one follows), or None where the checkpoint declares none."""
    modules_path = directory / "modules.json"
    if not modules_path.is_file():
        return None
    modules = [m for m in _read(modules_path) or [] if isinstance(m, dict)]
    pooling = None
    for module in modules:
        if _is_module(module, "Pooling"):
            config = _read(directory / str(module.get("path", "")) / "config.json")
            config = config if isinstance(config, dict) else {}
            modes = [name for key, name in MODES.items() if config.get(key)]
            named = config.get("pooling_mode")  # sentence-transformers 6
            if isinstance(named, str):
                modes.append(MODES.get(f"pooling_mode_{named}", MODES.get(f"pooling_mode_{named}_tokens", named)))
            pooling = "+".join(modes) or None
            break
    if any(_is_module(module, "Dense") for module in modules):
        return f"{pooling or 'its pooling'}, then a Dense projection"
    return pooling


def _is_module(module: dict, kind: str) -> bool:
    """A sentence-transformers module of this class (`sentence_transformers.models.Pooling`, or 6's
    `sentence_transformers.sentence_transformer.modules.pooling.Pooling`)."""
    name = str(module.get("type", ""))
    return name.startswith("sentence_transformers.") and name.rsplit(".", 1)[-1] == kind


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # a sentence-transformers extra, not what serves the model: unreadable is "none"
        return None
