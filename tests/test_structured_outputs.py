"""StructuredOutputsParams: exactly one constraint, each of the right type, refused with a sentence otherwise."""

import pytest

from jaxserve import SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams as S


@pytest.mark.parametrize("fields, kind", [
    (dict(json={"type": "object"}), "json"),
    (dict(json='{"type": "integer"}'), "json"),
    (dict(regex=r"\d+"), "regex"),
    (dict(choice=("yes", "no")), "choice"),
    (dict(grammar='start: "a"'), "grammar"),
    (dict(json_object=True), "json_object"),
])
def test_each_kind(fields, kind):
    params = S(**fields)
    assert params.kind == kind
    if kind == "json":
        assert isinstance(params.json, dict)  # JSON text is parsed once, here
    if kind == "choice":
        assert params.choice == ["yes", "no"]


@pytest.mark.parametrize("fields, words", [
    (dict(), "got none"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1, 2]), "schema object"),
    (dict(regex=""), "non-empty string"),
    (dict(grammar=3), "non-empty string"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", ""]), "non-empty list"),
    (dict(choice="a"), "non-empty list"),
    (dict(json_object="yes"), "must be true"),
])
def test_invalid_params_are_refused_by_name(fields, words):
    with pytest.raises(ValueError, match=words):
        S(**fields)


def test_sampling_params_take_a_dict_of_fields():
    params = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert params.structured_outputs == S(choice=["x", "y"]) and params.constrained
    assert not SamplingParams().constrained
    with pytest.raises(ValueError, match="unsupported fields schema"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="unsupported fields structural_tag"):
        SamplingParams(structured_outputs={"structural_tag": "{}"})
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams(structured_outputs="json")


def test_vllm_options_are_accepted_and_additional_properties_can_be_closed():
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}}}}
    closed = S.of({"json": nested, "disable_additional_properties": True, "disable_any_whitespace": True,
                   "whitespace_pattern": " ", "disable_fallback": True}).json
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in nested  # the request's own schema is left as sent
    assert S(json={"type": "object", "additionalProperties": True}, disable_additional_properties=True).json == \
        {"type": "object", "additionalProperties": True}  # what a schema says itself stands


def test_closing_follows_schema_keywords_not_property_names():
    """A property named "properties" is a name: its map is left alone and its own schema is closed; schemas under
    anyOf and $defs are closed too."""
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "u": {"anyOf": [{"type": "object", "properties": {"b": {}}}]}},
              "$defs": {"D": {"type": "object", "properties": {"c": {}}}}}
    closed = S(json=schema, disable_additional_properties=True).json
    assert set(closed["properties"]) == {"properties", "u"}  # no "additionalProperties" property was added
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["u"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False


def test_free_form_objects_stay_open_and_options_are_checked():
    schema = {"type": "object", "properties": {"meta": {"type": "object"}}}
    closed = S(json=schema, disable_additional_properties=True, disable_any_whitespace=True).json
    assert closed["additionalProperties"] is False and closed["properties"]["meta"] == {"type": "object"}
    with pytest.raises(ValueError, match="disable_additional_properties must be true or false"):
        S(json=schema, disable_additional_properties="no")
