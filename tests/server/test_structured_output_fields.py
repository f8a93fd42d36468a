"""Every spelling clients use for constrained output maps to the same StructuredOutputsParams."""

import pytest

from jaxserve.sampling_params import StructuredOutputsParams as S
from jaxserve.server.chat_protocol import ChatCompletionRequest
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.request_bodies import build_sampling_params

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, S(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     S(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "text"}, "guided_regex": "a+"}, S(regex="a+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, S(choice=["a", "b"])),
    ({"guided_json": SCHEMA}, S(json=SCHEMA)),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}, S(json=SCHEMA)),
    ({"guided_regex": r"\d+"}, S(regex=r"\d+")),
    ({"guided_choice": ["x"]}, S(choice=["x"])),
    ({"guided_grammar": 'start: "a"'}, S(grammar='start: "a"')),
    ({}, None),
])
@pytest.mark.parametrize("schema, base", [(CompletionRequest, {"prompt": "x"}),
                                          (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})])
def test_spellings(fields, expected, schema, base):
    params = build_sampling_params(schema.model_validate({**base, **fields}))
    assert params.structured_outputs == expected
