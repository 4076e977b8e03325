"""Named objects in namespaces, and the match / create / conflict decision (torch-free).

A namespace is one job's state: its objects and its journal.  ``bind`` takes a
batch of (name, dtype, shape) requests and is all-or-nothing: if any request
conflicts under the chosen policy, or memory runs out part way, nothing in the
daemon changes and the error names every offender.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from gpu_anchor.dtypes import check_shape, describe, nbytes_of
from gpu_anchor.errors import BadRequest

from .arena import Arena
from .journal import Journal

POLICIES = ("match_or_create", "replace", "lookup")
MAX_NAME = 4096


class ConflictError(ValueError):
    def __init__(self, conflicts: list[dict]):
        self.conflicts = conflicts
        lines = [f"{c['name']!r}: anchored as {c['have']}, requested {c['want']}" for c in conflicts]
        super().__init__("name conflict (anchored data left untouched): " + "; ".join(lines))


class OutOfMemory(MemoryError):
    pass


@dataclass
class AnchoredObject:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    segment: int
    offset: int
    generation: int

    def describe(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
                "segment": self.segment, "offset": self.offset, "generation": self.generation}


class Namespace:
    def __init__(self, name: str, version: int) -> None:
        self.name = name
        self.objects: dict[str, AnchoredObject] = {}
        self.journal = Journal()
        # the object table's version: drawn from the registry's counter at creation and at every
        # change of ``objects`` (create, replace, free), so within one daemon two different tables
        # of a namespace never share one, even across a drop and re-creation
        self.version = version


def check_name(kind: str, value: object, limit: int = MAX_NAME) -> str:
    if not isinstance(value, str) or not value or len(value) > limit or "\x00" in value:
        raise BadRequest(f"{kind} must be a non-empty string of at most {limit} characters, got {value!r:.80}",
                         field=kind.split()[-1])
    return value


class Registry:
    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.namespaces: dict[str, Namespace] = {}
        self._generation = itertools.count(1)
        self._versions = itertools.count(1)

    def namespace(self, name: str, create: bool = True) -> Namespace | None:
        check_name("namespace", name, 256)
        ns = self.namespaces.get(name)
        if ns is None and create:
            ns = self.namespaces[name] = Namespace(name, next(self._versions))
        return ns

    def bind(self, ns_name: str, requests: list, policy: str = "match_or_create") -> list[tuple[str, AnchoredObject | None]]:
        """Return ``[(status, object)]`` with status ``matched`` / ``created`` / ``missing``."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not isinstance(requests, list):
            raise ValueError("objects must be a list")
        ns = self.namespace(ns_name)
        parsed, seen = [], set()
        for i, req in enumerate(requests):
            if not isinstance(req, dict):
                raise BadRequest(f"objects[{i}] must be an object, got {req!r:.80}", field=f"objects[{i}]")
            name = check_name("object name", req.get("name"))
            if name in seen:
                raise BadRequest(f"object {name!r} requested twice in one bind", field=f"objects[{i}].name")
            seen.add(name)
            what, dtype = f"objects[{i}] {name!r:.200}", req.get("dtype")
            shape = check_shape(req.get("shape"), what, name)
            parsed.append((name, dtype, shape, nbytes_of(dtype, shape, what, name)))

        conflicts = []
        for name, dtype, shape, _ in parsed:
            old = ns.objects.get(name)
            if old is not None and (old.dtype, old.shape) != (dtype, shape):
                conflicts.append({"name": name, "have": describe(old.dtype, old.shape), "want": describe(dtype, shape)})
        if conflicts and policy != "replace":
            raise ConflictError(conflicts)

        results: list[tuple[str, AnchoredObject | None]] = []
        to_create = []
        for name, dtype, shape, nbytes in parsed:
            old = ns.objects.get(name)
            if old is not None and (old.dtype, old.shape) == (dtype, shape):
                results.append(("matched", old))
            elif policy == "lookup":
                results.append(("missing", None))
            else:
                to_create.append(len(results))
                results.append(("created", (name, dtype, shape, nbytes)))
        try:
            placed = self.arena.allocate_many([results[i][1][3] for i in to_create])
        except MemoryError as e:
            need = sum(results[i][1][3] for i in to_create)
            raise OutOfMemory(f"cannot allocate {need} B for {len(to_create)} object(s): {e}") from None
        for i, (seg, off) in zip(to_create, placed):
            name, dtype, shape, nbytes = results[i][1]
            results[i] = ("created", AnchoredObject(name, dtype, shape, nbytes, seg.id, off, next(self._generation)))
        replaced: list[AnchoredObject] = []
        for status, obj in results:
            if status == "created":
                old = ns.objects.get(obj.name)
                if old is not None:
                    replaced.append(old)
                ns.objects[obj.name] = obj
        for old in replaced:
            self.arena.release(old.segment, old.offset, old.nbytes)
        if to_create:
            ns.version = next(self._versions)
        return results

    def free(self, ns_name: str, names: list) -> list[str]:
        ns = self.namespace(ns_name, create=False)
        if not isinstance(names, list):
            raise ValueError("names must be a list")
        freed = []
        for entry in names:
            # ``name`` frees whatever is anchored under it; ``[name, generation]`` only that
            # incarnation, so a late free from a dead tensor never hits a recreated object.
            name, generation = (entry, None) if isinstance(entry, str) else (entry[0], entry[1]) \
                if isinstance(entry, list) and len(entry) == 2 else (None, None)
            check_name("object name", name)
            obj = ns.objects.get(name) if ns is not None else None
            if obj is not None and generation in (None, obj.generation):
                del ns.objects[name]
                self.arena.release(obj.segment, obj.offset, obj.nbytes)
                freed.append(name)
        if freed:
            ns.version = next(self._versions)
        return freed

    def drop(self, ns_name: str) -> int:
        ns = self.namespaces.pop(check_name("namespace", ns_name, 256), None)
        if ns is None:
            return 0
        for obj in ns.objects.values():
            self.arena.release(obj.segment, obj.offset, obj.nbytes)
        return len(ns.objects)

    def object_bytes(self) -> int:
        return sum(o.nbytes for ns in self.namespaces.values() for o in ns.objects.values())
