"""The checkpoint reader: verify one checkpoint and apply it to this rank's state.

Everything that can be checked is checked before the state is touched: the manifest, the fields against
the class (`strict`), whether pickled objects are needed (`trusted`), the checksums, the content's layout
and the modules' shapes. Then tensors are copied in place into the state's own tensors where shape and
dtype match, and the rest is applied with `apply_fields`. When the reader's in-memory state is expendable
the checksums are computed while the tensors are copied (one pass over the bytes); a mismatch then leaves
the state torn, which the election accounts for.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import attrs
import cloudpickle
import torch

from elastic._util.placement import Placement
from elastic._util.threads import one_torch_thread
from elastic.checkpoint.codec import (
    CONTENT,
    CONTENT_VERSION,
    OBJECTS,
    FormatError,
    decode_skeleton,
    slot_paths,
)
from elastic.checkpoint.content import TREE_KEY, hash_file
from elastic.checkpoint.manifest import InvalidCheckpoint, skipped, validate
from elastic.checkpoint.options import LoadOptions
from elastic.checkpoint.storage.base import Storage
from elastic.state.apply import apply_fields, fill_aliases, receive_targets
from elastic.state.config import saved_fields
from elastic.state.lineage import lineage, set_lineage
from elastic.state.nodes import (
    STRUCTURED,
    ContainerNode,
    Kind,
    StatefulNode,
    StateNode,
    TensorSlot,
    kind_of,
    node_kind,
    path_str,
)
from elastic.state.statedict import canonical_state_dict
from elastic.state.tensors import carriers, metas_of

__all__ = ["Refused", "Status", "Verification", "read", "read_into"]

log = logging.getLogger("elastic")


@attrs.frozen
class Status:
    """The reader's verdict: ``ok``, ``corrupt`` (skip it), or an error kind raised on every rank; and
    whether the reader's state was left torn (its tenure then counts as `None`).

    `cause` is the exception behind the verdict (torch's, the unpickler's, the storage's), on the reader
    only: it stays out of what the group is told (`shared`), and the reader raises its error from it."""

    kind: Literal["ok", "corrupt", "untrusted", "mismatch", "error"]
    message: str = ""
    torn: bool = False
    cause: BaseException | None = attrs.field(default=None, eq=False, repr=False)

    def shared(self) -> Status:
        """The verdict as the other ranks receive it (without the local `cause`)."""
        return attrs.evolve(self, cause=None)


class Refused(Exception):
    """A checkpoint this state cannot take (`kind`: ``untrusted``, ``mismatch`` or ``error``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def read(state: Any, directory: Any, options: LoadOptions, *, stream: bool) -> Status:
    """Verify `directory` and apply it to `state`; never raises (the verdict goes to every rank)."""
    storage = options.storage
    try:
        with storage.session(directory):
            read_into(state, directory, options, stream=stream)
        return Status("ok")
    except InvalidCheckpoint as exc:
        skipped("load", str(exc))
        return Status("corrupt", str(exc), torn=lineage(state).torn, cause=exc.__cause__)
    except Refused as exc:
        kind: Any = exc.kind
        return Status(kind, str(exc), torn=lineage(state).torn, cause=exc.__cause__)
    except Exception as exc:
        text = f"reading {directory} failed: {storage.explain(exc) or f'{type(exc).__name__}: {exc}'}"
        return Status("error", text, torn=lineage(state).torn, cause=exc)


class Verification:
    """Checksums of one file computed on a helper thread (`wait` raises `InvalidCheckpoint`)."""

    def __init__(self, directory: Any, manifest: dict[str, Any], name: str, storage: Storage) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(directory, manifest, name, storage), name="elastic-verify", daemon=True
        )
        self._thread.start()

    def _run(self, directory: Any, manifest: dict[str, Any], name: str, storage: Storage) -> None:
        try:
            _verify(directory, manifest, name, storage)
        except BaseException as exc:
            self._error = exc

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _verify(directory: Any, manifest: dict[str, Any], name: str, storage: Storage) -> None:
    rec = manifest["files"][name]
    fpath = storage.join(directory, name)
    try:
        size, digest = hash_file(storage, fpath, rec["chunk"])
    except OSError as exc:
        raise InvalidCheckpoint(f"{fpath}: cannot be read ({exc})") from exc
    if size != rec["size"]:
        raise InvalidCheckpoint(
            f"{fpath}: is {size} bytes, the manifest says {rec['size']}: truncated or altered"
        )
    if digest != rec[TREE_KEY]:
        raise InvalidCheckpoint(f"{fpath}: checksum mismatch: the file is damaged or was altered")


def read_into(state: Any, directory: Any, options: LoadOptions, *, stream: bool) -> None:
    """Read, verify and apply one checkpoint. With `stream`, the content file is verified while it is
    parsed and copied in (the state is torn if it turns out corrupt); otherwise before."""
    storage = options.storage
    manifest = validate(directory, storage).manifest
    cls = type(state)
    saved_class = manifest.get("class")
    if saved_class != f"{cls.__module__}.{cls.__qualname__}":
        log.warning(
            "load: %s was saved from class %s, loading into %s.%s",
            directory,
            saved_class,
            cls.__module__,
            cls.__qualname__,
        )
    live = [a.name for a in saved_fields(cls)]
    saved = [f["name"] for f in manifest["fields"]]
    _check_fields(directory, live, saved, "", strict=options.strict)
    applied = [n for n in saved if n in live]
    needed = [o for o in manifest["objects"] if o.get("field") in applied]
    if needed and not options.trusted:
        names = sorted({str(o.get("field")) for o in needed})
        detail = ", ".join(f"{o.get('path')} ({o.get('type')})" for o in needed[:8])
        more = f" and {len(needed) - 8} more" if len(needed) > 8 else ""
        msg = (
            f"{directory} stores pickled objects in field(s) {', '.join(repr(n) for n in names)}: "
            f"{detail}{more}. Unpickling can run arbitrary code, so it is refused by default; pass "
            "trusted=True for checkpoints you made yourself (or whose author you trust), or store plain data "
            "(numbers, strings, lists, dicts, tensors) in these fields"
        )
        raise Refused("untrusted", msg)
    verification = Verification(directory, manifest, CONTENT, storage) if stream else None
    if verification is None:
        _verify(directory, manifest, CONTENT, storage)
    try:
        node, tensors, devices = _parse(state, directory, manifest, options, applied, needed)
    except BaseException:
        if verification is not None:
            verification.wait()  # a checksum mismatch explains a parse failure best
        raise
    _apply(state, node, tensors, devices, verification.wait if verification is not None else None)


def _parse(
    state: Any,
    directory: Any,
    manifest: dict[str, Any],
    options: LoadOptions,
    applied: list[str],
    needed: list[Any],
) -> tuple[StateNode, list[torch.Tensor], list[str]]:
    """Load the content (weights_only, memory-mapped where the storage maps files) and objects, decode the
    skeleton and check it against the live state. Writes nothing into the state."""
    storage = options.storage
    objects: list[Any] = []
    opath, cpath = storage.join(directory, OBJECTS), storage.join(directory, CONTENT)
    if needed:
        _verify(directory, manifest, OBJECTS, storage)
        try:
            with storage.open_read(opath) as f:
                objects = cloudpickle.load(f)
        except Exception as exc:
            msg = (
                f"could not unpickle {opath} ({type(exc).__name__}: {exc}); the classes and "
                "functions it refers to must be importable here"
            )
            raise Refused("error", msg) from exc
        if not isinstance(objects, list):
            raise InvalidCheckpoint(f"{opath}: does not hold a list of objects")
    try:
        payload = _load_content(storage, cpath)
    except Exception as exc:  # the message has torch's first line; its whole error stays the cause
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise InvalidCheckpoint(f"{cpath}: cannot be loaded safely ({type(exc).__name__}: {text})") from exc
    tensors, devices, skeleton = _unpack(cpath, payload, applied, objects)
    node = _reconcile(skeleton, state, (), tensors, directory, strict=options.strict)
    return node, tensors, devices


def _load_content(storage: Storage, location: Any) -> Any:
    """`torch.load(weights_only=True)` of the content file: memory-mapped from a local file, else read."""
    local = storage.local_path(location)
    if local is not None:
        return torch.load(local, map_location="cpu", weights_only=True, mmap=True)
    with storage.open_read(location) as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def _unpack(
    where: Any, payload: Any, applied: list[str], objects: list[Any]
) -> tuple[list[torch.Tensor], list[str], StateNode]:
    if not (isinstance(payload, dict) and payload.get("format") == CONTENT_VERSION):
        raise InvalidCheckpoint(f"{where}: is not an elastic-state content file of version {CONTENT_VERSION}")
    tensors, devices, plain = payload.get("tensors"), payload.get("devices"), payload.get("skeleton")
    if not (
        isinstance(tensors, list)
        and all(isinstance(t, torch.Tensor) for t in tensors)
        and isinstance(devices, list)
        and len(devices) == len(tensors)
        and all(isinstance(d, str) for d in devices)
        and isinstance(plain, dict)
        and isinstance(plain.get("f"), dict)
    ):
        raise InvalidCheckpoint(f"{where}: has a malformed layout")
    pruned = dict(plain)
    pruned["f"] = {n: v for n, v in plain["f"].items() if n in applied}

    def obj(i: int) -> Any:
        if i >= len(objects):
            raise FormatError(f"object {i} is not in {OBJECTS}")
        return objects[i]

    try:
        skeleton = decode_skeleton(pruned, len(tensors), obj)
    except FormatError as exc:
        raise InvalidCheckpoint(f"{where}: {exc}") from exc
    return tensors, devices, skeleton


def _check_fields(directory: Path, live: list[str], saved: list[str], prefix: str, *, strict: bool) -> None:
    missing = [prefix + n for n in live if n not in saved]
    extra = [prefix + n for n in saved if n not in live]
    if not (missing or extra):
        return
    if strict:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing)}")
        if extra:
            parts.append(f"in the checkpoint but not in the class: {', '.join(extra)}")
        msg = (
            f"{directory} does not match the state's fields ({'; '.join(parts)}). Pass strict=False to keep "
            "current values for missing fields and ignore extra ones"
        )
        raise Refused("mismatch", msg)
    if extra:
        text = f"load: {directory} has fields the class no longer has, ignored: {', '.join(extra)}"
        log.warning("%s", text)
        warnings.warn(text, RuntimeWarning, stacklevel=6)
    if missing:
        log.info("load: %s lacks fields %s; their current values are kept", directory, ", ".join(missing))


def _a(kind: Kind) -> str:
    return "None" if kind == Kind.NONE else f"a {kind}"


def _reconcile(
    node: StateNode,
    state: Any,
    path: tuple[Any, ...],
    tensors: list[torch.Tensor],
    directory: Path,
    *,
    strict: bool,
) -> StateNode:
    """Check the checkpoint's fields against the live state before anything is written; prune extras."""
    live = [a.name for a in saved_fields(type(state))]
    if path:
        prefix = path_str(path) + "."
        _check_fields(directory, live, list(node.fields), prefix, strict=strict)
    fields: dict[str, Any] = {}
    for name, child in node.fields.items():
        if name not in live:
            continue
        current = getattr(state, name)
        where = path_str((*path, name))
        have, want = kind_of(current), node_kind(child)
        if have != want and (have in STRUCTURED or want in STRUCTURED):  # plain values of any kind load
            msg = (
                f"{directory}: field {where} holds {_a(want)} in the checkpoint but {_a(have)} in this "
                "state; build the field as the saved state did (a module, optimizer, scheduler or nested "
                "state is loaded into in place, never built by load; plain values load whatever their kind)"
            )
            raise Refused("mismatch", msg)
        if isinstance(child, StateNode):
            child = _reconcile(child, current, (*path, name), tensors, directory, strict=strict)
        elif isinstance(child, StatefulNode) and child.kind == Kind.MODULE:
            _check_module(child, current, where, tensors, directory)
        fields[name] = child
    return StateNode(qualname=type(state).__qualname__, fields=fields)


def _check_module(
    node: StatefulNode, module: Any, where: str, tensors: list[torch.Tensor], directory: Path
) -> None:
    inner = node.inner
    if not isinstance(inner, ContainerNode) or inner.kind != Kind.DICT:
        return
    saved = {
        k: tuple(tensors[c.index].shape)
        for k, c in zip(inner.keys, inner.children)
        if isinstance(c, TensorSlot)
    }
    have = {  # names without DDP / torch.compile prefixes, as they were saved
        k: tuple(v.shape) for k, v in canonical_state_dict(module).items() if isinstance(v, torch.Tensor)
    }
    problems = [f"{k}: missing from the checkpoint" for k in have if k not in saved]
    problems += [f"{k}: not in this module" for k in saved if k not in have]
    problems += [
        f"{k}: shape {saved[k]} saved, {have[k]} here" for k in saved if k in have and saved[k] != have[k]
    ]
    if problems:
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        msg = (
            f"{directory}: module {where} does not match the checkpoint ({'; '.join(problems[:8])}{more}); "
            "build the model with the same architecture and sizes as the one that was saved"
        )
        raise Refused("mismatch", msg)


def _apply(
    state: Any,
    node: StateNode,
    tensors: list[torch.Tensor],
    devices: list[str],
    verified: Callable[[], None] | None = None,
) -> None:
    """Write the checkpoint into `state`: tensors in place where shape and dtype match. Torn on failure.

    `verified`, when given, is waited for after the tensors are copied and before anything else changes;
    it raises if the checksums do not match (the state is then left torn)."""
    paths = slot_paths(node)
    slots = [i for i in range(len(tensors)) if i in paths]
    # the loaded tensors share storage as the saved ones did: aliases become views again
    metas = metas_of([paths[i] for i in slots], [tensors[i] for i in slots], [devices[i] for i in slots])
    cpu = Placement(torch.device("cpu"))
    # the state's own tensor wherever shape and dtype match (copy_ crosses devices), else a new one (with
    # the saved strides and requires_grad) on the device type it was saved from where available
    found, fits = receive_targets(
        state, metas, "save", lambda m: cpu.allocate_on(m.device_type), any_device=True
    )
    targets = list(tensors)
    in_place = [False] * len(tensors)
    for i, target, mine in zip(slots, found, fits):
        targets[i], in_place[i] = target, mine
    set_lineage(state, token=None, torn=True)  # until the whole checkpoint is in
    with torch.no_grad(), one_torch_thread():
        for n in carriers(metas):
            found[n].detach().copy_(tensors[slots[n]])
        fill_aliases(found, metas)
        if verified is not None:
            verified()
        apply_fields(state, node, targets, in_place)
    set_lineage(state, token=None, torn=False)
