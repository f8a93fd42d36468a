"""layers.dense on weights converted inside the step: in slices of their outputs when asked (ModelConfig's
dequantize_slice_bytes), the same numbers with a smaller temporary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import dense

RNG = np.random.default_rng(0)


def groups_4_bit(shape: tuple[int, ...], axis: int) -> dict[str, np.ndarray]:
    """A weight of `shape` in 4-bit groups of 32 along `axis` (its contracted one): two values a byte there."""
    packed, grouped = list(shape), list(shape)
    packed[axis] //= 2
    grouped[axis] //= 32
    return {"w": RNG.integers(0, 256, packed).astype(np.uint8), "w_scale": RNG.random(grouped, np.float32) * 0.01,
            "w_offset": RNG.random(grouped, np.float32) * -0.08}


CASES = {  # spec, x's shape, the weight (each of them a float32 copy of 1,024,000 bytes)
    "4-bit groups": ("TD,DF->TF", (3, 256), groups_4_bit((256, 1000), 0)),
    "int8 per channel": ("TD,DF->TF", (3, 256), {"w": RNG.integers(-127, 128, (256, 1000)).astype(np.int8),
                                                 "w_scale": RNG.random(1000, np.float32)}),
    # two output axes (q heads and head_dim): the widest is sliced
    "q projection": ("TD,DHd->THd", (3, 256), groups_4_bit((256, 10, 100), 0)),
    # experts' blocks, an axis x shares (N) wider than the weight's own output axis (F): F is sliced
    "experts": ("NRD,NDF->NRF", (40, 3, 256), groups_4_bit((40, 256, 25), 1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_weight_converted_in_output_slices_gives_the_same_output_with_a_smaller_temporary(case):
    spec, x_shape, weights = CASES[case]
    x = jnp.asarray(RNG.standard_normal(x_shape, np.float32))
    weights = {name: jnp.asarray(a) for name, a in weights.items()}

    def program(slice_bytes: int):
        return jax.jit(lambda x, w: dense(spec, x, w, "w", slice_bytes=slice_bytes))

    whole, sliced = program(0), program(96 << 10)  # copies of at most 96 KiB, some slices shorter
    # the same sums, each in its own order (the matmul's blocking follows its width): float32 rounding apart
    expected = whole(x, weights)
    np.testing.assert_allclose(sliced(x, weights), expected, rtol=0, atol=1e-6 * float(jnp.abs(expected).max()))
    temporaries = [p.lower(x, weights).compile().memory_analysis().temp_size_in_bytes for p in (whole, sliced)]
    assert temporaries[0] >= 1_024_000 > 5 * temporaries[1], temporaries
