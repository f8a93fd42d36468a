"""The XLA flags jaxserve sets before jax starts (jaxserve/xla_flags.py): XLA:CPU's sequential scheduler, which
keeps one layer's dequantized weights alive at a time where the concurrency-optimized one kept them all."""

import os
import subprocess
import sys
from pathlib import Path

from jaxserve.xla_flags import (
    CPU_SCHEDULER_FLAG,
    DEPRECATED_SCHEDULER_FLAG,
    cpu_scheduler_flag,
    set_default_xla_flags,
)

SEQUENTIAL = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"


def test_the_flag_joins_the_user_s_flags_once_and_never_overrides_theirs():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    set_default_xla_flags(env, "0.10.2")
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {SEQUENTIAL}"
    set_default_xla_flags(env, "0.10.2")  # a second import, or a child process that inherited it
    assert env["XLA_FLAGS"].count(CPU_SCHEDULER_FLAG) == 1
    # a scheduler the user chose, in either form (XLA takes the later flag: ours would override theirs)
    for theirs in (cpu_scheduler_flag(concurrent=True), f"{DEPRECATED_SCHEDULER_FLAG}=true"):
        env = {"XLA_FLAGS": theirs}
        set_default_xla_flags(env, "0.10.2")
        assert env["XLA_FLAGS"] == theirs
    empty = {}
    set_default_xla_flags(empty, "0.10.0")
    assert empty["XLA_FLAGS"] == SEQUENTIAL


def test_a_jaxlib_it_was_not_checked_on_gets_no_flag():
    """XLA refuses to start on a flag it does not know: only checked versions get it."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    set_default_xla_flags(env, "0.11.2")
    assert env == {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


# A step's shape in miniature: 30 layers whose 4-bit weights are dequantized before their matmuls. The dequantized
# weights do not depend on the activations, so a scheduler that starts independent work early keeps them all.
PROGRAM = """
import jax, jax.numpy as jnp
from jaxserve.models.layers import dense
L, D, F = 30, 256, 512
weights = [{"w": jnp.zeros((D // 2, F), jnp.uint8), "w_scale": jnp.ones((D // 32, F)), "w_offset": jnp.ones((D // 32, F))}
           for _ in range(L)]
def layers(x, weights):
    for w in weights:
        x = dense("td,df->tf", x, w, "w")[:, :D]
    return x
compiled = jax.jit(layers).lower(jnp.ones((1, D)), weights).compile()
print(compiled.memory_analysis().temp_size_in_bytes)
"""


def test_importing_jaxserve_keeps_one_layer_s_temporaries_alive_not_all():
    """What the flag is for, through XLA itself: the program above compiled in a process that imported jaxserve
    first holds about one dequantized weight (512 KiB) in temporaries; with XLA's default scheduler, all 30, asked
    for with the enum or with the deprecated boolean (which jaxserve then leaves as the user gave it)."""
    temps = {}
    for name, flags in (("default", ""), ("concurrent", cpu_scheduler_flag(concurrent=True)),
                        ("concurrent, deprecated flag", f"{DEPRECATED_SCHEDULER_FLAG}=true")):
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run([sys.executable, "-c", "import jaxserve\n" + PROGRAM], capture_output=True, text=True,
                              env=env, timeout=120, cwd=Path(__file__).parents[1])
        assert done.returncode == 0, done.stderr[-2000:]
        temps[name] = int(done.stdout.split()[-1])
    one_weight = 256 * 512 * 4
    assert temps["default"] < 3 * one_weight, temps
    assert temps["concurrent"] > 20 * one_weight and temps["concurrent, deprecated flag"] > 20 * one_weight, temps
