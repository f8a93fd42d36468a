"""Acceptance: `use_beam_search` on the real server (SmolLM2) answers with the engine's own beams, best first."""

from jaxserve import BeamSearchParams
from tests.server.helpers import REAL_MODEL

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is 2+2? Answer with one number."}]


def _expected_texts(engine, prompt, beam_width, max_tokens):
    [output] = engine.beam_search([prompt], BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens),
                                  use_tqdm=False)
    return [engine.tokenizer.decode(seq.generated_ids, skip_special_tokens=True) for seq in output.sequences], output


def test_completion_choices_are_the_beams_best_first(openai_client, smol_engine):
    result = openai_client.completions.create(model=REAL_MODEL, prompt=PROMPT, max_tokens=8, n=3,
                                              temperature=0.7, extra_body={"use_beam_search": True})
    texts, output = _expected_texts(smol_engine, PROMPT, 3, 8)
    assert [choice.text for choice in result.choices] == texts
    assert [choice.index for choice in result.choices] == [0, 1, 2]
    assert [choice.finish_reason for choice in result.choices] == [seq.finish_reason for seq in output.sequences]
    assert result.usage.completion_tokens == sum(len(seq.generated_ids) for seq in output.sequences)


def test_chat_beams_end_at_eos_and_stream_whole(openai_client, smol_engine):
    result = openai_client.chat.completions.create(model=REAL_MODEL, messages=QUESTION, max_tokens=12, n=2,
                                                   extra_body={"use_beam_search": True})
    texts, output = _expected_texts(smol_engine, smol_engine.encode_chat(QUESTION), 2, 12)
    assert [choice.message.content for choice in result.choices] == texts
    assert [choice.finish_reason for choice in result.choices] == ["stop", "stop"]
    chunks = list(openai_client.chat.completions.create(model=REAL_MODEL, messages=QUESTION, max_tokens=12, n=2,
                                                        stream=True, extra_body={"use_beam_search": True}))
    streamed = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
