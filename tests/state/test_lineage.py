"""The lineage registry: per instance, weakly held, torn marks kept."""

from __future__ import annotations

import attrs

import elastic
from elastic import elastic_state
from elastic.state.lineage import lineage, set_lineage


@elastic_state(tenure="step")
@attrs.define
class Plain:
    step: int = 0
    note: str = ""


def test_torn_state_has_no_tenure_and_lineage_is_per_instance() -> None:
    a, b = Plain(step=5), Plain(step=5)
    set_lineage(a, token="t1", torn=True)
    assert elastic.tenure(a) is None
    assert elastic.tenure(b) == 5
    assert lineage(b).token is None
    set_lineage(a, token="t2", torn=False)
    assert elastic.tenure(a) == 5 and lineage(a).token == "t2"


def test_lineage_is_dropped_with_the_instance() -> None:
    from elastic.state import lineage as _lineage

    s = Plain()
    set_lineage(s, token="x", torn=False)
    key = id(s)
    assert key in _lineage._registry
    del s
    import gc

    gc.collect()
    assert key not in _lineage._registry
