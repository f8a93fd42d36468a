#!/usr/bin/env python
"""Peak host memory while loading weights onto a mesh: each mesh in its own fresh process (8 fake CPU devices),
so one run's peak does not hide another's.

    python scripts/bench_load_memory.py [--meshes 1x1 8x1 4x2] [--model PATH]

Per mesh: the process's resident memory just before loading (imports, checkpoint reader and tokenizer open),
its peak (ru_maxrss) after `ModelRunner` has placed every weight, the difference, and the bytes the placed
weights occupy summed over devices. On CPU the fake devices' buffers are host memory too, so the placed weights
count in the peak: loading stays near one copy when the difference stays near those bytes, not a copy per device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, resource, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, psutil
from jaxserve.loader.checkpoint import open_checkpoint
from jaxserve.config import MeshShape
from jaxserve.runner.model_runner import ModelRunner

ckpt = open_checkpoint(sys.argv[2])
before = psutil.Process().memory_info().rss
runner = ModelRunner(ckpt.config, ckpt.tensors, "float32", 16, MeshShape.parse(sys.argv[1]))
jax.block_until_ready(runner.params)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
placed = sum(s.data.nbytes for leaf in jax.tree.leaves(runner.params) for s in leaf.addressable_shards)
print(json.dumps(dict(before=before, peak=peak, placed=placed)))
"""


def measure(mesh: str, model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mesh, model], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["1x1", "8x1", "4x2"])
    parser.add_argument("--model", default=None, help="checkpoint (default: the SmolLM2 GGUF)")
    args = parser.parse_args()
    if args.model is None:
        from jaxserve.loader.default_model import default_model_path

        args.model = str(default_model_path())
    mib = 1 << 20
    print("| mesh | RSS before load (MiB) | peak RSS (MiB) | peak - before (MiB) | placed weights, all devices (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for mesh in args.meshes:
        m = measure(mesh, args.model)
        print(f"| {mesh} | {m['before'] / mib:.0f} | {m['peak'] / mib:.0f} | {(m['peak'] - m['before']) / mib:.0f} | "
              f"{m['placed'] / mib:.0f} |", flush=True)


if __name__ == "__main__":
    main()
