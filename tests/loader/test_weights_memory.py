"""Loading holds one stacked copy of a layer weight, not two: a 70B model's stacked MLP weight is tens of GB."""

import tracemalloc

import numpy as np
import pytest

from jaxserve.loader.weights import stacker_on_host


def test_stacking_layers_holds_one_copy_of_the_result_in_the_target_dtype():
    layers, shape = 16, (256, 512)
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal(shape, dtype=np.float32) for _ in range(layers)]
    result_bytes = layers * np.prod(shape) * 2  # float16 target: half the float32 source
    tracemalloc.start()
    try:
        # each layer a fresh float32 array
        stacked = stacker_on_host(lambda name: tensors[int(name)] * 1.0)("*", (layers,), lambda w: w, np.float16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stacked.dtype == np.float16 and stacked.shape == (layers, *shape)
    np.testing.assert_array_equal(stacked[3], tensors[3].astype(np.float16))
    layer_bytes = np.prod(shape) * 4
    # np.stack then astype held the float32 layers, their stack and the result: over 3x this bound
    assert peak <= result_bytes + 3 * layer_bytes


def test_a_layer_of_another_shape_is_named_not_broadcast():
    shapes = [(4, 8), (4, 8), (1,)]
    with pytest.raises(ValueError, match=r"model.layers.2.w has shape \(1,\), the first one's \(4, 8\)"):
        stacker_on_host(lambda name: np.ones(shapes[int(name.split(".")[2])], np.float32))(
            "model.layers.*.w", (3,), lambda w: w, np.float32)


def test_an_expert_of_another_shape_is_named_by_layer_and_expert():
    def get(name):  # "layers.I.experts.E.w"
        i, e = int(name.split(".")[1]), int(name.split(".")[3])
        return np.ones((1,) if (i, e) == (1, 2) else (4, 8), np.float32) if name.endswith("w") else np.full(4, 10 * i + e)

    with pytest.raises(ValueError, match=r"layers.1.experts.2.w has shape \(1,\), the first one's \(4, 8\)"):
        stacker_on_host(get)("layers.*.experts.*.w", (2, 3), lambda w: w, np.float32)
    stacked = stacker_on_host(get)("layers.*.experts.*.v", (2, 3), lambda w: w, np.int32)
    assert stacked.shape == (2, 3, 4) and stacked[1, 2, 0] == 12
