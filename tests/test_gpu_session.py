"""scripts/gpu_session.sh all, dry run: every part of a GPU session on tiny shapes on the CPU, each script's
figures checked where they can be known (float32 on the CPU is exact; the roofline's bytes are counted by hand).
It is also the end-to-end test of scripts/bench_pipeline_model.py and scripts/bench_layer_loop.py."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from jaxserve.xla_flags import cpu_scheduler_flag

ROOT = Path(__file__).parents[1]


# Compiled unoptimised, as the suite's other tiny models are: its parts' scripts run tiny shapes a few steps each,
# and XLA's optimisations cost more than they save there (measured alone from a cold cache: 176 s -> 152 s wall, 202 -> 182 s of CPU).
def test_gpu_session_all_dry_run(tmp_path, tiny_tokenizer_source):
    # The accuracy check's tiny model takes the tiny checkpoints' tokenizer (as a GPU session takes the one it
    # carries): from the GGUF, transformers parsed the whole file first (~12 s).
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "JAXSERVE_TEST_TOKENIZER_DIR": tiny_tokenizer_source}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), "all"], capture_output=True, text=True,
                          timeout=900, env=env)
    log = (tmp_path / "all.log").read_text()
    assert done.returncode == 0 and "all: done in" in log, done.stdout[-3000:] + done.stderr[-3000:]

    # The session says whether its jaxlib knows the XLA:CPU scheduler flag jaxserve sets (this one does)
    assert f"this jaxlib knows {cpu_scheduler_flag(concurrent=False)}" in (tmp_path / "device.txt").read_text()

    accuracy = json.loads((tmp_path / "accuracy.json").read_text())
    assert accuracy["jaxserve"]["agreement"] == 1.0 and accuracy["jaxserve"]["goal_met"]  # float32: exact
    assert accuracy["int8"]["vs_cpu_variant"]["agreement"] == 1.0  # the same variant on the same CPU
    assert accuracy["structured"]["valid"]

    cold, warm = (json.loads((tmp_path / "coldstart.json").read_text())[k] for k in ("cold", "warm"))
    assert cold["answered"] and warm["answered"]
    assert cold["programs_done"] == cold["programs"] == warm["programs"] > 0
    assert cold["cache_files_added"] > 0 and warm["cache_files_added"] == 0  # the second start read every program

    synthetic = json.loads((tmp_path / "synthetic.json").read_text())
    assert "output_tok_s" in synthetic, log[-3000:]  # a part that stopped early left its first figures only
    # bench_synthetic's tiny shape in float32 (tests/test_roofline.py counts these by hand), a batch-1 context of
    # 16 prompt + (4 + 100) / 2 tokens, read as five 16-token blocks of 512 bytes a token.
    assert synthetic["step_bytes_parts"] == dict(layer_weights=295_936, final_norm=256, lm_head=131_072,
                                                 kv=80 * 512, embedding_not_read=131_072)
    assert synthetic["decode_ms"] > 0
    assert synthetic["offline_compiles"] == 0  # the best run is a warm one
    assert synthetic["output_tok_s"] * 20 == pytest.approx(synthetic["total_tok_s"] * 4)  # 16 in + 4 out each

    fp8 = json.loads((tmp_path / "synthetic_fp8.json").read_text())
    assert "output_tok_s" in fp8, log[-3000:]
    assert fp8["quantization"] == "fp8" and fp8["output_tok_s"] > 0 and fp8["offline_compiles"] == 0
    # its roofline counts a byte a weight and the scales (float32: 4 bytes a weight)
    assert 3.5 < synthetic["step_bytes_parts"]["layer_weights"] / fp8["step_bytes_parts"]["layer_weights"] < 4

    # The pipeline part: the schedule recorded on two fake devices, every stage busy on every tick, and the model
    pipeline = re.search(r"^pp=2 schedule of 2 sequences, recorded over (\d+) ticks: stages busy on \[(\d+), (\d+)\]",
                         log, re.MULTILINE)
    assert pipeline and pipeline[1] == pipeline[2] == pipeline[3], log[-3000:]
    # then its five engines' steps, and the model from them, unless this CPU's noise (the suite runs beside it)
    # hid the 32 layers' time, which the script says instead of modelling on noise
    assert len(re.findall(r"^decode step, (32|64) layers, batch [12], vocabulary (512|128): ", log, re.MULTILINE)) == 5
    modelled = re.search(r"^pp=2 \(32 layers a stage, 2 micro-batches\), batch 2: data parallel ", log, re.MULTILINE)
    assert modelled or "the machine's noise is larger than the layers' time" in log, log[-3000:]

    # The kept part: each storage's scan program, and its ratio to the unrolled layers (a scan over 2 tiny layers
    # slices each stacked array once per step: 3 per 4-bit or 8-bit weight, 1 per float one)
    assert re.findall(r"^scan program: (\d+) dynamic-slice ops", log, re.MULTILINE) == ["21", "21", "14", "7"]
    assert len(re.findall(r"^scan / unrolled at batch 1: \d+\.\d+x$", log, re.MULTILINE)) == 4

    rows = [r for r in (tmp_path / "benchmark_rows.md").read_text().splitlines() if r.startswith("| 20")]
    commands = [r.split("`")[1] for r in rows]
    pipeline_rows = ["scripts/bench_pipeline_model.py"] if modelled else []
    assert [c.split()[0] for c in commands] == ["scripts/bench_synthetic.py"] + pipeline_rows + [
        "scripts/bench_layer_loop.py"] * 4 + ["scripts/bench_coldstart.py", "scripts/bench_synthetic.py"], commands
    assert "--quantization fp8" in commands[0]
    # the kept part's one process: a row for each storage, in the order measured
    shapes = [r.split("|")[5] for r in rows if "bench_layer_loop" in r]
    assert [re.search(r"(\w+) groups", s)[1] if "groups" in s else "float" for s in shapes] == [
        "int4", "uint4", "int8", "float"], shapes
    # The kernels' step: its pytest line ran (on the GPU image, without pytest-xdist's --dist) and passed.
    assert re.search(r"^\d+ passed in ", log, re.MULTILINE) and not re.search(r"\d+ (failed|error)", log), log[-3000:]
