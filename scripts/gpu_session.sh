#!/usr/bin/env bash
# The checks a session with a lent GPU owes issues 4 and 9, each step one device call (the device tool's `run`,
# 10 minutes a call; 15 minutes of device time a session since 2026-11-26, a machine's start included, so one
# or two steps a session). The GPU image has jax, flax, transformers and torch but not `gguf`
# (which jaxserve's loader imports), so carry its wheel. Once, here (not on the device), in the repo root:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf
#   python3 -c "from jaxserve.loader.default_model import default_model_path as p; from transformers import \
#     AutoTokenizer as T; T.from_pretrained(p().parent, gguf_file=p().name).save_pretrained('.whl/smol-tokenizer')"
#
# (the tiny parity checkpoints take SmolLM2's tokenizer; its 93 MB GGUF is over the device's 64 MiB carry limit
# and cannot be fetched there)
#
# then, with the device tool:   run(command="bash scripts/gpu_session.sh kernels", carry=[".whl"])
#                               run(command="bash scripts/gpu_session.sh synthetic", carry=[".whl"])
#                               run(command="bash scripts/gpu_session.sh sync", carry=[".whl"])
#
#   kernels    compiled Pallas kernels against their references, engine parity through them (float32, tiny
#              Llama), then scripts/bench_kernels.py (decode kernel vs JAX's bundled one and the roofline),
#              scripts/bench_layer_loop.py (scan vs unrolled layers, 8B shape) and scripts/bench_sampler.py (the
#              top-k/p filter, search vs sort, 256 x 128256)
#   synthetic  scripts/bench_synthetic.py: Llama-3-8B shape, bfloat16: batch-1 decode vs the roofline, 1000 x
#              (1000 in + 100 out) offline throughput, transformers on the same GPU
#   sync       the same without transformers and with --no-async-scheduling: what overlapping host work buys
#   tune       scripts/tune_decode_kernel.py: the decode kernel's knobs swept at six shapes (~5 minutes)
#   decode     issue 4's open goals in one call: tune_decode_kernel.py at 64x2048, 8x8192 and 1x512, bench_kernels.py
#              at the best setting, the compiled kernel and parity tests, Nsight Compute if time is left (~9 min)
#   profile    Nsight Compute on both decode kernels at batch 64 x 2048 (issue 4's bandwidth goal): duration, DRAM
#              throughput, occupancy, registers, warp stalls; then ours with --prefetch none
#
# Logs and BENCHMARKS.md rows land in $OUT (the device tool brings them back); copy the rows into BENCHMARKS.md.
#
# Compiles: the offline run meets about 19 step shapes (counted on CPU with `--shape tiny` and the same
# scheduler settings), each an 8B-layer program to compile. If `synthetic` reaches the call's 10-minute limit,
# call it again at once: while the machine is still warm (30 s after a call) the programs already compiled are
# read from jaxserve's persistent compilation cache (~/.cache/jaxserve/xla there), and the log in $OUT says
# how far the first call got.
set -uo pipefail
step=${1:?usage: scripts/gpu_session.sh kernels|synthetic|sync|tune|decode|profile}
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out"
cd "$(dirname "$0")/.."

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "no .whl/ wheels: see the top of $0 (the GPU image lacks the gguf package)" >&2
  export PYTHONPATH=$PWD
fi
[ -d .whl/smol-tokenizer ] && export JAXSERVE_TEST_TOKENIZER_DIR=$PWD/.whl/smol-tokenizer
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/device.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >>"$out/device.txt" 2>&1
cat "$out/device.txt"

case "$step" in
  kernels)
    # The test on the real SmolLM2 engine needs its GGUF, which cannot reach the device. The parity tests run the
    # layers unrolled there ("auto" on GPU, runner/layer_loop.py).
    PALLAS_COMPILED=1 python3 -m pytest -q -p no:cacheprovider pallas_kernels tests/models/test_parity_pallas.py \
      -k "not test_only_the_kernels_compile_decode_variants" 2>&1 | tee "$out/kernel_tests.log"
    python3 scripts/bench_kernels.py --append "$out/benchmark_rows.md" 2>&1 | tee "$out/bench_kernels.log"
    # The layer loop, scanned over stacked weights vs unrolled over per-layer ones (runner/layer_loop.py).
    python3 scripts/bench_layer_loop.py --append "$out/benchmark_rows.md" 2>&1 | tee "$out/bench_layer_loop.log"
    # The sampler's top-k/p filter at GPU batch and Llama-3 vocabulary sizes: sort-free search vs a sort.
    python3 scripts/bench_sampler.py --rows 256 --vocab 128256 --append "$out/benchmark_rows.md" 2>&1 \
      | tee "$out/bench_sampler.log"
    ;;
  synthetic)
    python3 scripts/bench_synthetic.py --append "$out/benchmark_rows.md" 2>&1 | tee "$out/bench_synthetic.log"
    ;;
  sync)
    python3 scripts/bench_synthetic.py --no-transformers --no-async-scheduling --append "$out/benchmark_rows.md" \
      2>&1 | tee "$out/bench_synthetic_sync.log"
    ;;
  tune)
    python3 scripts/tune_decode_kernel.py 2>&1 | tee "$out/tune_decode_kernel.log"
    ;;
  decode)
    # Issue 4's open goals in one call of under 9.5 minutes (a session's device time is 15 minutes, a machine's
    # start included): the knobs swept where the goals are hardest, the 12-shape table at the sweep's best
    # setting, the compiled tests, then Nsight Compute at 64 x 2048 with whatever time is left. Each part stops
    # at its own limit so the later ones still run.
    deadline=$((SECONDS + ${DECODE_BUDGET_S:-540}))
    # Seconds for the next part: its own cap, or what is left (at least 1: `timeout 0` would mean no limit).
    left() { local n=$((deadline - SECONDS)); n=$((n < $1 ? n : $1)); echo $((n > 0 ? n : 1)); }
    timeout "$(left 210)" python3 scripts/tune_decode_kernel.py --shapes 64x2048 8x8192 1x512 --iters 3 \
      --best "$out/best.txt" 2>&1 | tee "$out/tune_decode_kernel.log"
    best=$(cat "$out/best.txt" 2>/dev/null)
    timeout "$(left 120)" python3 scripts/bench_kernels.py --iters 5 $best --append "$out/benchmark_rows.md" 2>&1 \
      | tee "$out/bench_kernels.log"
    PALLAS_COMPILED=1 timeout "$(left 170)" python3 -m pytest -q -p no:cacheprovider pallas_kernels \
      tests/models/test_parity_pallas.py -k "not test_only_the_kernels_compile_decode_variants" 2>&1 \
      | tee "$out/kernel_tests.log"
    [ "$(left 60)" -lt 40 ] || timeout "$(left 60)" ncu --clock-control none -k regex:paged --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      python3 scripts/bench_kernels.py --shapes 64x2048 --iters 1 $best 2>&1 | tee "$out/ncu_decode.log"
    ;;
  profile)
    # The first two matching launches at the one shape: ours, then JAX's (bench_kernels compares them first).
    for extra in "" "--prefetch none"; do  # the defaults (page ids a step ahead), then without prefetching
      ncu --clock-control none -k regex:paged --launch-count 2 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 scripts/bench_kernels.py --shapes 64x2048 --iters 1 $extra 2>&1 | tee -a "$out/ncu_decode.log"
    done
    ;;
  *)
    echo "unknown step $step: use kernels, synthetic, sync, tune, decode or profile" >&2
    exit 2
    ;;
esac
