"""scripts/gpu_session.sh all, dry run: every step of a GPU session on tiny shapes on the CPU, each script's
figures checked where they can be known (float32 on the CPU is exact; the roofline's bytes are counted by hand)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.xla_optimised  # its benchmarks run many steps
def test_gpu_session_all_dry_run(tmp_path, tiny_tokenizer_source):
    # The accuracy check's tiny model takes the tiny checkpoints' tokenizer (as a GPU session takes the one it
    # carries): from the GGUF, transformers parsed the whole file first (~12 s).
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "JAXSERVE_TEST_TOKENIZER_DIR": tiny_tokenizer_source}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), "all"], capture_output=True, text=True,
                          timeout=900, env=env)
    log = (tmp_path / "all.log").read_text()
    assert done.returncode == 0 and "all: done in" in log, done.stdout[-3000:] + done.stderr[-3000:]

    accuracy = json.loads((tmp_path / "accuracy.json").read_text())
    assert accuracy["jaxserve"]["agreement"] == 1.0 and accuracy["jaxserve"]["goal_met"]  # float32: exact
    assert accuracy["int8"]["vs_cpu_variant"]["agreement"] == 1.0  # the same variant on the same CPU
    assert accuracy["structured"]["valid"]

    cold, warm = (json.loads((tmp_path / "coldstart.json").read_text())[k] for k in ("cold", "warm"))
    assert cold["answered"] and warm["answered"]
    assert cold["programs_done"] == cold["programs"] == warm["programs"] > 0
    assert cold["cache_files_added"] > 0 and warm["cache_files_added"] == 0  # the second start read every program

    synthetic = json.loads((tmp_path / "synthetic.json").read_text())
    # bench_synthetic's tiny shape in float32 (tests/test_roofline.py counts these by hand), a batch-1 context of
    # 16 prompt + (4 + 12) / 2 tokens, read as two 16-token blocks of 512 bytes a token.
    assert synthetic["step_bytes_parts"] == dict(layer_weights=295_936, final_norm=256, lm_head=131_072,
                                                 kv=32 * 512, embedding_not_read=131_072)
    assert synthetic["offline_compiles"] == 0  # the best run is a warm one
    assert synthetic["output_tok_s"] * 20 == pytest.approx(synthetic["total_tok_s"] * 4)  # 16 in + 4 out each

    rows = (tmp_path / "benchmark_rows.md").read_text().splitlines()
    assert [r.split("`")[1].split()[0] for r in rows] == ["scripts/bench_coldstart.py", "scripts/bench_synthetic.py"]
    # The kernels' step: its pytest line ran (on the GPU image, without pytest-xdist's --dist) and passed.
    assert re.search(r"^\d+ passed in ", log, re.MULTILINE) and not re.search(r"\d+ (failed|error)", log), log[-3000:]
