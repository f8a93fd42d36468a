"""Compile buckets: every step the scheduler can form lands on a shape warm-up compiled."""

import pytest

from jaxserve.runner.buckets import Buckets


@pytest.mark.parametrize("max_tokens, max_seqs", [(512, 64), (256, 16), (64, 4), (8, 2), (16, 64), (1000, 48)])
def test_every_step_shape_is_a_warmed_up_shape_and_decodes_get_t_equal_b(max_tokens, max_seqs):
    buckets = Buckets.for_limits(max_tokens, max_seqs)
    compiled = set(buckets.forward_shapes())
    for seqs in range(1, min(max_seqs, max_tokens) + 1):
        for tokens in range(seqs, max_tokens + 1):  # at least one token per sequence
            assert buckets.shape(tokens, seqs) in compiled, (tokens, seqs)
        T, B = buckets.shape(seqs, seqs)  # a decode-only step
        assert T == B, (seqs, T, B)


def test_default_limits_buckets():
    buckets = Buckets.for_limits(512, 64)
    assert buckets.tokens == (1, 4, 16, 32, 64, 128, 256, 512)
    assert buckets.seqs == (1, 4, 16, 32, 64)
