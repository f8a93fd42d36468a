import pytest

from jaxserve.core.detokenizer import IncrementalDetokenizer, find_stop, holdback

MULTIBYTE = "日本語 🙂 café — ½ 👩‍👩‍👧 naïve"


def decode(tok, ids, skip_special_tokens=True):
    return tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(tok, prompt_ids, output_ids, chunk=1, **kwargs):
    """Push output_ids `chunk` at a time; return the detokenizer and the pieces it emitted."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    pieces = [detok.push(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    return detok, pieces


@pytest.mark.parametrize("chunk", [1, 3])
def test_multibyte_characters_stream_whole(smol_tokenizer, chunk):
    tok = smol_tokenizer
    prompt = tok.encode("Say it:")
    output = tok.encode(" " + MULTIBYTE)
    assert any("\ufffd" in tok.decode([t]) for t in output)  # the text really splits characters over tokens
    detok, pieces = stream(tok, prompt, output, chunk=chunk)
    assert "".join(pieces) == decode(tok, output) == " " + MULTIBYTE
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces or chunk > 1  # held back while a character was incomplete
    assert detok.text == " " + MULTIBYTE and detok.output_token_ids == output


def test_leading_space_of_first_output_token(smol_tokenizer):
    tok = smol_tokenizer
    prompt, output = tok.encode("Hello"), tok.encode(" world, again")
    detok, pieces = stream(tok, prompt, output)
    assert pieces[0] == " world"
    assert detok.text == " world, again"


def test_prompt_ending_anywhere(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("ab 日本語 🙂 end")
    full_text = decode(tok, ids)
    for cut in range(1, len(ids)):
        detok, pieces = stream(tok, ids[:cut], ids[cut:])
        streamed = "".join(pieces) + detok.flush()
        if decode(tok, ids[:cut]).endswith("\ufffd"):
            # A character split between prompt and output is dropped; nothing after it is garbled.
            assert full_text.endswith(streamed) and "\ufffd" not in streamed
        else:
            assert streamed == decode(tok, ids[cut:])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smol_tokenizer, skip):
    tok = smol_tokenizer
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    prompt = tok.encode("user\nhi") + [im_end] + tok.encode("\n") + [im_start] + tok.encode("assistant\n")
    output = tok.encode("Hi there!") + [im_end] + tok.encode("\n") + [im_start]
    detok, pieces = stream(tok, prompt, output, skip_special_tokens=skip)
    assert "".join(pieces) == decode(tok, output, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is not skip
    assert detok.text.startswith("Hi there!")


def test_flush_drops_an_unfinished_character(smol_tokenizer):
    """A length limit that cuts a character short: the text ends before it (vLLM's text), not in U+FFFD."""
    tok = smol_tokenizer
    output = tok.encode("日本語")  # 語 is three byte-tokens
    detok, pieces = stream(tok, tok.encode("a"), output[:-1])  # 語's last byte never arrives
    assert "".join(pieces) == "日本"
    assert decode(tok, output[:-1]) == "日本\ufffd"
    assert detok.flush() == ""
    assert detok.text == "日本"


def test_flush_emits_the_text_held_back_before_an_unfinished_character(smol_tokenizer):
    tok = smol_tokenizer
    # A token holding whole characters and the start of another (" " and two of a dash's three bytes, say)
    held = next(t for t in range(tok.vocab_size)
                if (text := decode(tok, [t])).endswith("\ufffd") and text.rstrip("\ufffd"))
    whole = decode(tok, [held]).rstrip("\ufffd")
    detok, pieces = stream(tok, tok.encode("a"), [held])
    assert pieces == [""]  # held back whole while it ends in an unfinished character
    assert detok.flush() == whole and detok.text == whole


def test_decode_token(smol_tokenizer):
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, [])
    (space_world,) = tok.encode(" world")
    assert detok.decode_token(space_world) == " world"
    assert detok.decode_token(tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    assert detok.decode_token(len(tok) + 10) == ""  # padded vocabulary rows decode to nothing


def test_out_of_vocab_ids_are_ignored(smol_tokenizer):
    tok = smol_tokenizer
    output = tok.encode("one two")
    _, pieces = stream(tok, [], [output[0], len(tok) + 5, output[1]])
    assert "".join(pieces) == "one two"


def test_find_stop_only_matches_ending_in_new_text():
    # "STOP" straddles the boundary between old text ("...ST") and new text ("OP...").
    text = "abc ST" + "OP and more"
    assert find_stop(text, len("OP and more"), ["STOP"]) == (4, "STOP")
    # A match entirely inside the old text was already handled by an earlier call.
    assert find_stop("STOP then", len(" then"), ["STOP"]) is None
    assert find_stop("abc", 3, ["x"]) is None
    # several stops in one piece of new text: the one completing first wins, as text written a character at a time
    # would stop (vLLM's rule): "bc" completes before "abcd" though it starts later; a tie goes to the listed first
    assert find_stop("abcd", 4, ["abcd", "bc"]) == (1, "bc")
    assert find_stop("xabcd", 4, ["cd", "abcd"]) == (3, "cd")


def test_find_stop_takes_the_earliest():
    text = "the end. ### done"
    assert find_stop(text, len(text), ["###", "end"]) == (4, "end")
    assert find_stop(text, 5, ["###", "end", "done"]) == (13, "done")
    assert find_stop("xab", 3, ["ab", "a"]) == (1, "a")  # "a" completes first: a character at a time it stopped
    assert find_stop("xab", 3, ["ab", "xab"]) == (1, "ab")  # both complete at once: the stop listed first


def test_holdback():
    assert holdback("hello ##", ["###"]) == 2
    assert holdback("hello #", ["###", "#!"]) == 1
    assert holdback("hello", ["###"]) == 0
    assert holdback("abc", ["bcd", "cde"]) == 2
    assert holdback("x<|im", ["<|im_end|>"]) == 4
    assert holdback("###", ["###"]) == 2  # "##" could start the next "###"
    assert holdback("a#b", ["#c"]) == 0
    assert holdback("", ["###"]) == 0
    assert holdback("ab", []) == 0


def test_fast_tokenizers_decode_through_the_rust_library_with_the_same_text(smol_tokenizer):
    """The shortcut past transformers' decode wrapper (rust_decode) gives its exact text, specials included."""
    import numpy as np

    from jaxserve.core.detokenizer import rust_decode

    tok = smol_tokenizer
    fast = rust_decode(tok)
    assert fast is not None
    rng = np.random.default_rng(0)
    specials = tok.all_special_ids
    for _ in range(50):
        ids = rng.integers(0, len(tok), rng.integers(1, 12)).tolist() + [int(rng.choice(specials))]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == decode(tok, ids, skip_special_tokens=skip)


def test_a_tokenizer_with_its_own_decode_keeps_it(smol_tokenizer):
    from jaxserve.core.detokenizer import rust_decode

    class Custom(type(smol_tokenizer)):
        def decode(self, token_ids, **kwargs):
            return "x" * len(token_ids)  # one "x" per id: each pushed token adds one

    custom = Custom.__new__(Custom)
    custom.__dict__.update(smol_tokenizer.__dict__)
    assert rust_decode(custom) is None
    assert IncrementalDetokenizer(custom, [1]).push([5, 6]) == "xx"
