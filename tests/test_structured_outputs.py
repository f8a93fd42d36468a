"""StructuredOutputsParams: exactly one constraint, each of the right type, refused with a sentence otherwise."""

import pytest

from jaxserve import SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams as S


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
    with pytest.raises(ValueError, match="unknown fields schema"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams(structured_outputs="json")
