"""The decorator: options checked at decoration time, generated methods, frozen/slotted/plain classes."""

from __future__ import annotations

import inspect
import warnings
import weakref

import attrs
import pytest
import torch

import elastic
from elastic import elastic_state
from elastic.state.config import config_of
from elastic.state.lineage import lineage, set_lineage


@elastic_state(tenure="step")
@attrs.define
class Plain:
    step: int = 0
    note: str = ""


def test_string_tenure_reads_the_field() -> None:
    s = Plain(step=7)
    assert elastic.tenure(s) == 7
    assert config_of(s).tenure_field == "step"


def test_callable_tenure_and_none() -> None:
    @elastic_state(tenure=lambda s: (s.epoch, s.step) if s.step else None)
    @attrs.define
    class S:
        epoch: int = 0
        step: int = 0

    assert elastic.tenure(S()) is None
    assert elastic.tenure(S(epoch=2, step=3)) == (2, 3)


def test_keyword_only_and_missing_tenure() -> None:
    with pytest.raises(TypeError, match=r"keyword arguments only.*@elastic_state\(tenure="):
        elastic_state(Plain)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="needs tenure="):
        elastic_state()


@pytest.mark.parametrize("bad", [3, 2.5, ["step"], None])
def test_tenure_must_be_callable_or_string(bad: object) -> None:
    with pytest.raises(TypeError, match=r"must be a callable or a field name, got"):
        elastic_state(tenure=bad)  # type: ignore[arg-type]


def test_tenure_string_must_name_a_field() -> None:
    with pytest.raises(TypeError, match=r"tenure='stp'\) names no field of .*Only.*\['step'\]"):

        @elastic_state(tenure="stp")
        @attrs.define
        class Only:
            step: int = 0


def test_tenure_callable_arity_checked() -> None:
    with pytest.raises(TypeError, match=r"tenure=.*must accept 1 positional argument"):
        elastic_state(tenure=lambda: 0)


def test_on_sync_must_be_callable_with_two_arguments() -> None:
    with pytest.raises(TypeError, match=r"on_sync=.*must be callable as on_sync\(state, report\)"):
        elastic_state(tenure="step", on_sync="rescale")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"on_sync=.*must accept 2 positional argument"):
        elastic_state(tenure="step", on_sync=lambda s: None)


def test_plain_annotated_class_becomes_attrs() -> None:
    @elastic_state(tenure="step")
    class Bare:
        step: int = 0
        lr: float = 0.1

    assert attrs.has(Bare)
    b = Bare(step=3)
    assert (b.step, b.lr) == (3, 0.1)
    assert elastic.tenure(b) == 3


def test_class_that_cannot_be_made_attrs() -> None:
    with pytest.raises(TypeError, match=r"could not make .*Broken an attrs class .*No mandatory attributes"):

        @elastic_state(tenure="b")
        class Broken:
            a: int = 1
            b: int  # a mandatory field after a defaulted one


def test_not_a_class() -> None:
    with pytest.raises(TypeError, match="decorates classes"):
        elastic_state(tenure="step")(lambda: None)  # type: ignore[type-var]


def test_generated_methods_have_names_docs_and_signatures() -> None:
    for name in ("sync", "save", "load", "state_dict", "load_state_dict"):
        method = getattr(Plain, name)
        assert method.__qualname__ == f"Plain.{name}"
        assert method.__module__ == __name__
        assert method.__doc__
    params = list(inspect.signature(Plain.sync).parameters)
    assert params == ["self", "group", "src", "force", "timeout"]
    assert list(inspect.signature(Plain.save).parameters)[:2] == ["self", "path"]


def test_user_methods_are_never_overwritten() -> None:
    @elastic_state(tenure="step")
    @attrs.define
    class Custom:
        step: int = 0

        def state_dict(self) -> dict[str, int]:
            return {"mine": self.step}

        def sync(self) -> str:
            return "user sync"

    c = Custom(step=4)
    assert c.state_dict() == {"mine": 4}
    assert c.sync() == "user sync"
    assert Custom.load.__qualname__ == f"{Custom.__qualname__}.load"  # the ones it did not define are added


def test_frozen_and_slotted_classes() -> None:
    @elastic_state(tenure="step")
    @attrs.frozen
    class Frozen:
        step: int
        weight: torch.Tensor

    f = Frozen(step=2, weight=torch.ones(3))
    assert elastic.tenure(f) == 2
    assert f.sync().world_size == 1  # no process group: a local no-op
    assert "__slots__" in Frozen.__dict__
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        f.step = 3  # type: ignore[misc]

    with pytest.warns(
        UserWarning, match=r"NoWeakref: its instances cannot be weakly referenced.*no fast path"
    ):

        @elastic_state(tenure="step")
        @attrs.define(slots=True, weakref_slot=False)
        class NoWeakref:
            step: int = 0

    n = NoWeakref()
    with pytest.raises(TypeError):
        weakref.ref(n)
    set_lineage(n, token="abc", torn=False)
    assert lineage(n).token is None  # cannot be tracked weakly: never takes the fast path
    set_lineage(n, token="abc", torn=True)
    assert lineage(n).torn and elastic.tenure(n) is None  # but a torn mark is always kept


def test_sync_without_process_group_is_local_and_calls_on_sync() -> None:
    seen = []

    @elastic_state(tenure="step", on_sync=lambda s, r: seen.append((s.step, r)))
    @attrs.define
    class S:
        step: int = 0

    s = S(step=9)
    report = elastic.sync(s)
    assert report == elastic.SyncReport(
        src=0, tenure=9, world_size=1, tensor_bytes=0, object_bytes=0, seconds=0.0
    )
    assert seen == [(9, report)]
    assert s.sync() == report
    assert elastic.most_tenured_rank(s) == 0


def test_functions_reject_undecorated_states() -> None:
    @attrs.define
    class NotDecorated:
        step: int = 0

    with pytest.raises(TypeError, match=r"needs an instance of an @elastic_state class, got .*NotDecorated"):
        elastic.sync(NotDecorated())
    with pytest.raises(TypeError, match=r"needs an instance of an @elastic_state class"):
        elastic.tenure(Plain)  # the class, not an instance


def test_timeout_must_be_a_timedelta_or_seconds() -> None:
    with pytest.raises(TypeError, match=r"sync\(timeout=...\) must be a timedelta"):
        elastic.sync(Plain(), timeout="10s")  # type: ignore[arg-type]


def test_subclass_inherits_generated_methods() -> None:
    @elastic_state(tenure="step")
    @attrs.define
    class Child(Plain):
        extra: int = 1

    c = Child(step=3)
    assert elastic.tenure(c) == 3
    assert c.sync().tenure == 3


def test_a_tenure_reading_a_local_field_warns_at_decoration() -> None:
    with pytest.warns(UserWarning, match=r"the tenure reads 'seen', a field that is never synced"):

        @elastic_state(tenure=lambda s: (s.step, s.seen))
        @attrs.define
        class ReadsLocal:
            step: int = 0
            seen: int = elastic.local(default=0)

    with pytest.warns(UserWarning, match=r"the tenure reads 'mine'"):

        @elastic_state(tenure="mine")
        @attrs.define
        class NamesLocal:
            mine: int = elastic.field(sync=False, default=0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @elastic_state(tenure=lambda s: s.step)
        @attrs.define
        class Fine:
            step: int = 0
            seen: int = elastic.local(default=0)

    assert elastic.tenure(Fine(step=3)) == 3
