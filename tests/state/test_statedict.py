"""The kept walk of plain module trees: what `state_dict()` gives, and every change to the tree seen."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

from elastic.state import statedict as _statedict
from elastic.state.statedict import canonical_state_dict, kept_walk


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    m[0].register_buffer("scratch", torch.zeros(2), persistent=False)
    m[2].register_parameter("unused", None)
    return m


def _as_state_dict(m: torch.nn.Module) -> list[tuple[str, int, bool]]:
    walk = kept_walk(m)
    assert walk is not None
    return [(k, t.data_ptr(), t.requires_grad) for k, t in zip(walk.keys, walk.tensors())]


def _expected(m: torch.nn.Module) -> list[tuple[str, int, bool]]:
    return [(k, t.data_ptr(), t.requires_grad) for k, t in canonical_state_dict(m).items()]


def test_a_plain_tree_gives_what_state_dict_gives_and_is_kept() -> None:
    m = _model()
    assert _as_state_dict(m) == _expected(m)  # names, order, tensors, detached; no scratch, no None
    first = kept_walk(m)
    assert kept_walk(m) is first
    assert "0.scratch" not in first.keys and "2.unused" not in first.keys  # type: ignore[union-attr]
    assert first.paths(("model",)) is first.paths(("model",))  # type: ignore[union-attr]
    assert first.paths(("model",))[0] == ("model", "0.weight")  # type: ignore[union-attr]


def _replace_param(m: Any) -> None:
    m[0].weight = torch.nn.Parameter(torch.ones(4, 3))


def _add_param(m: Any) -> None:
    m[2].unused = torch.nn.Parameter(torch.ones(1))


def _add_buffer(m: Any) -> None:
    m[2].register_buffer("seen", torch.zeros(1))


def _persist(m: Any) -> None:
    m[0]._non_persistent_buffers_set.discard("scratch")


def _replace_child(m: Any) -> None:
    m[2] = torch.nn.Linear(4, 2)


def _add_child(m: Any) -> None:
    m.append(torch.nn.Linear(2, 2))


def _rename(m: Any) -> None:
    m[0]._parameters["w"] = m[0]._parameters.pop("weight")


def _pre_hook(m: Any) -> None:
    m[1].register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)


def _post_hook(m: Any) -> None:
    m[1]._register_state_dict_hook(lambda module, sd, prefix, meta: None)


def _new_class(m: Any) -> None:
    class Other(torch.nn.Linear):
        pass

    m[2].__class__ = Other


@pytest.mark.parametrize(
    "change",
    [_replace_param, _add_param, _add_buffer, _persist, _replace_child, _add_child, _rename, _new_class],
)
def test_every_change_to_the_tree_is_seen(change: Callable[[Any], None]) -> None:
    m = _model()
    first = kept_walk(m)
    change(m)
    again = kept_walk(m)
    assert again is not first
    assert _as_state_dict(m) == _expected(m)


@pytest.mark.parametrize("hook", [_pre_hook, _post_hook])
def test_a_state_dict_hook_makes_the_tree_not_plain(hook: Callable[[Any], None]) -> None:
    m = _model()
    assert kept_walk(m) is not None
    hook(m)
    assert kept_walk(m) is None


def test_a_replaced_data_is_seen_while_the_walk_is_kept() -> None:
    m = _model()
    first = kept_walk(m)
    m[0].weight.data = torch.full((4, 3), 2.0)
    assert kept_walk(m) is first  # the same parameter object: the tree did not change...
    assert _as_state_dict(m) == _expected(m)  # ...and its tensors are detached as they are now
    assert first.tensors()[0].sum().item() == 24.0  # type: ignore[union-attr]


class _Custom(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))


class _OwnStateDict(_Custom):
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return {"w": self.w.detach() * 2}


class _OwnSave(_Custom):
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "w2"] = self.w.detach()


class _Extra(_Custom):
    def get_extra_state(self) -> Any:
        return {"seen": 1}

    def set_extra_state(self, state: Any) -> None:
        pass


@pytest.mark.parametrize("cls", [_OwnStateDict, _OwnSave, _Extra])
def test_modules_with_their_own_state_dict_are_not_plain(cls: type) -> None:
    assert kept_walk(cls()) is None
    assert kept_walk(torch.nn.Sequential(torch.nn.Linear(1, 1), cls())) is None


def test_ties_shared_modules_and_wrappers_keep_state_dict_names() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    m[1].weight = m[0].weight
    shared = torch.nn.Linear(2, 2)
    outer = torch.nn.ModuleDict({"a": shared, "b": shared, "m": m})
    assert _as_state_dict(outer) == _expected(outer)
    compiled = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2)))
    assert kept_walk(compiled).keys == ("0.weight", "0.bias")  # type: ignore[union-attr]
    assert _as_state_dict(compiled) == _expected(compiled)


def test_the_kept_walk_goes_with_its_module() -> None:
    m = _model()
    kept_walk(m)
    key = id(m)
    assert key in _statedict._walks
    del m
    gc.collect()
    assert key not in _statedict._walks


def test_an_override_on_the_instance_or_a_class_patched_later_is_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = _model()
    assert kept_walk(m) is not None
    m[0].state_dict = lambda *a, **k: {"only": torch.zeros(1)}  # type: ignore[method-assign]
    assert kept_walk(m) is None
    del m[0].state_dict

    class Patched(torch.nn.Linear):
        pass

    n = torch.nn.Sequential(Patched(2, 2))
    assert kept_walk(n) is not None
    monkeypatch.setattr(Patched, "_save_to_state_dict", lambda self, d, prefix, keep: None, raising=False)
    assert kept_walk(n) is None


def test_the_walk_holds_neither_the_model_nor_what_was_dropped_from_it() -> None:
    import weakref

    m = _model()
    m[2].owner = {"model": m}  # a child that refers back to the root: a cycle through the model
    m[0].weight.register_hook(lambda g, held=m: g * held[0].in_features)  # another cycle
    kept_walk(m)
    dropped = weakref.ref(m[1])
    m[1] = torch.nn.Identity()  # dropped after a walk: freed, not kept alive by the snapshot
    gc.collect()
    assert dropped() is None
    kept_walk(m)
    root = weakref.ref(m)
    del m
    gc.collect()
    assert root() is None
