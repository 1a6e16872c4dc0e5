"""Field policies carried in attrs metadata."""

from __future__ import annotations

import attrs
import pytest

import elastic
from elastic.state.config import saved_fields, synced_fields
from elastic.state.fields import POLICY_KEY, FieldPolicy, policy_of


@elastic.elastic_state(tenure="step")
@attrs.define
class S:
    step: int = 0
    synced_only: int = elastic.field(save=False, default=1)
    saved_only: int = elastic.field(sync=False, default=2)
    scratch: dict = elastic.local(factory=dict)  # type: ignore[type-arg]
    tagged: int = elastic.field(default=3, metadata={"user": "kept"})


def test_policies() -> None:
    fields = attrs.fields_dict(S)
    assert policy_of(fields["step"]) == FieldPolicy(sync=True, save=True)
    assert policy_of(fields["synced_only"]) == FieldPolicy(sync=True, save=False)
    assert policy_of(fields["saved_only"]) == FieldPolicy(sync=False, save=True)
    assert policy_of(fields["scratch"]) == FieldPolicy(sync=False, save=False)
    assert fields["tagged"].metadata["user"] == "kept"
    assert isinstance(fields["tagged"].metadata[POLICY_KEY], FieldPolicy)


def test_selection_in_definition_order() -> None:
    assert [a.name for a in synced_fields(S)] == ["step", "synced_only", "tagged"]
    assert [a.name for a in saved_fields(S)] == ["step", "saved_only", "tagged"]


def test_attrs_keywords_pass_through() -> None:
    s = S()
    assert (s.synced_only, s.saved_only, s.scratch, s.tagged) == (1, 2, {}, 3)
    assert S(scratch={"a": 1}).scratch == {"a": 1}


def test_flags_must_be_booleans() -> None:
    with pytest.raises(TypeError, match=r"elastic.field\(sync=...\) must be True or False, got 'yes'"):
        elastic.field(sync="yes")  # type: ignore[arg-type]
