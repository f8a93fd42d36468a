"""core/token_rules.py on its own: the bans a bad word asks for, with and without a token in flight, and the bitmask of
allowed tokens."""

import numpy as np
import pytest

from jaxserve.core.token_rules import ALWAYS, allowed_bitmask, bad_word_bans

WORDS = ((5,), (1, 2), (1, 2, 3))


@pytest.mark.parametrize("outputs, expected", [
    ([], [(5, ALWAYS)]),
    ([9, 1], [(5, ALWAYS), (2, ALWAYS)]),
    ([1, 2], [(5, ALWAYS), (3, ALWAYS)]),
    ([1], [(5, ALWAYS), (2, ALWAYS)]),
    ([2, 1], [(5, ALWAYS), (2, ALWAYS)]),
])
def test_bans_when_every_token_is_known(outputs, expected):
    assert bad_word_bans(WORDS, outputs, in_flight=False) == expected


@pytest.mark.parametrize("outputs, expected", [
    ([], [(5, ALWAYS), (2, 1)]),  # the in-flight token may be a word's first
    ([1], [(5, ALWAYS), (2, 1), (3, 2)]),  # "1 ?": the three-token word if ? is 2
    ([7], [(5, ALWAYS), (2, 1)]),
])
def test_bans_that_depend_on_the_token_in_flight(outputs, expected):
    assert bad_word_bans(WORDS, outputs, in_flight=True) == expected


def test_allowed_bitmask_sets_exactly_the_allowed_bits():
    vocab = 70
    ids = [0, 31, 32, 69, 31]
    mask = allowed_bitmask(ids, vocab)
    assert mask.shape == (3,) and mask.dtype == np.int32
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    assert np.flatnonzero(bits).tolist() == [0, 31, 32, 69]
    with pytest.raises(ValueError, match="token id 70, outside the vocabulary"):
        allowed_bitmask([70], vocab)


def test_the_bias_slots_count_the_sequences_eos_ids():
    """A model whose config names no EOS bans the tokenizer's under min_tokens: that slot counts too."""
    from types import SimpleNamespace

    from jaxserve.engine.inputs import resolve_token_rules
    from jaxserve.runner.sampler import BIAS_SLOTS
    from jaxserve.sampling_params import SamplingParams

    config = SimpleNamespace(model=SimpleNamespace(vocab_size=1000, eos_token_ids=()))
    full = SamplingParams(logit_bias={t: 1.0 for t in range(300)}, stop_token_ids=list(range(300, BIAS_SLOTS - 1)))
    assert resolve_token_rules(full, None, config, eos_token_ids=(999,)) == (None, ())
    with pytest.raises(ValueError, match=f"need {BIAS_SLOTS + 1} token entries"):
        resolve_token_rules(full, None, config, eos_token_ids=(998, 999))


def test_rules_that_leave_no_token_are_refused():
    from types import SimpleNamespace

    from jaxserve.engine.inputs import resolve_token_rules
    from jaxserve.sampling_params import SamplingParams

    class OneTokenPerWord:
        def encode(self, text, add_special_tokens=False):
            return [{"a": 5, " a": 5, "b": 6, " b": 6}[text]]

    config = SimpleNamespace(model=SimpleNamespace(vocab_size=100, eos_token_ids=()))

    def resolve(**rules):
        return resolve_token_rules(SamplingParams(**rules), OneTokenPerWord(), config, eos_token_ids=(2,))

    with pytest.raises(ValueError, match="allowed_token_ids leaves no token that bad_words does not ban"):
        resolve(allowed_token_ids=[5, 6], bad_words=["a", "b"])
    with pytest.raises(ValueError, match="only end-of-sequence and stop tokens, which min_tokens=3 bans"):
        resolve(allowed_token_ids=[2, 7], stop_token_ids=[7], min_tokens=3)
    assert resolve(allowed_token_ids=[5, 6], bad_words=["a"])[1] == ((5,),)  # one token left: fine
    assert resolve(allowed_token_ids=[2, 7], stop_token_ids=[7])[0] is not None  # no min_tokens: may end at once
    assert resolve(allowed_token_ids=[2, 7, 9], stop_token_ids=[7], min_tokens=3)[0] is not None
