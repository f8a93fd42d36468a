"""layers.dense on weights converted inside the step: in slices of their outputs when asked (ModelConfig's
dequantize_slice_bytes), the same numbers with a smaller temporary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import dense

RNG = np.random.default_rng(0)
K, N = 256, 1000  # a float32 copy of 1,024,000 bytes
GROUPS_4_BIT = {"w": RNG.integers(0, 256, (K // 2, N)).astype(np.uint8),  # two 4-bit values a byte
                "w_scale": RNG.random((K // 32, N), np.float32) * 0.01,
                "w_offset": RNG.random((K // 32, N), np.float32) * -0.08}
PER_CHANNEL_INT8 = {"w": RNG.integers(-127, 128, (K, N)).astype(np.int8), "w_scale": RNG.random(N, np.float32)}


@pytest.mark.parametrize("weights", [GROUPS_4_BIT, PER_CHANNEL_INT8], ids=["4-bit groups", "int8 per channel"])
def test_a_weight_converted_in_output_slices_gives_the_same_output_with_a_smaller_temporary(weights):
    x = jnp.asarray(RNG.standard_normal((3, K), np.float32))
    weights = {name: jnp.asarray(a) for name, a in weights.items()}

    def program(slice_bytes: int):
        return jax.jit(lambda x, w: dense("TD,DF->TF", x, w, "w", slice_bytes=slice_bytes))

    whole, sliced = program(0), program(96 << 10)  # 11 slices of 91 columns, the last of 90
    # the same sums, each in its own order (the matmul's blocking follows its width): float32 rounding apart
    expected = whole(x, weights)
    np.testing.assert_allclose(sliced(x, weights), expected, rtol=0, atol=1e-6 * float(jnp.abs(expected).max()))
    temporaries = [p.lower(x, weights).compile().memory_analysis().temp_size_in_bytes for p in (whole, sliced)]
    assert temporaries[0] >= K * N * 4 > 5 * temporaries[1], temporaries
