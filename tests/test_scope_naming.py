"""The access-path walk on plain objects: deterministic, first path wins, cycles, slots,
tensor dict keys, and roots that must not be entered."""
from __future__ import annotations

import os
import types

import torch
from torch import nn

from gpu_anchor.scope.naming import access_paths


class Slotted:
    __slots__ = ("w", "other")

    def __init__(self):
        self.w = torch.zeros(1)


class Node:
    def __init__(self, t):
        self.t = t
        self.me = self            # a cycle


def test_paths_for_objects_containers_slots_and_cycles():
    shared = torch.ones(2)
    s = Slotted()
    s.other = shared
    roots = {"b": {"k2": shared, "k1": [torch.zeros(3), (torch.zeros(4),)]}, "a": Node(torch.zeros(5)), "s": s}
    names = access_paths(roots)
    assert set(names) == {"a.t", "b['k1'][0]", "b['k1'][1][0]", "b['k2']", "s.w"}   # shared: first path only
    assert names["b['k2']"] is shared


def test_first_path_is_the_shortest_then_lexicographic():
    t = torch.zeros(1)
    names = access_paths({"z": t, "a": {"deep": {"deeper": t}}})
    assert list(names) == ["z"]
    names = access_paths({"y": {"b": t}, "x": {"c": t}})
    assert list(names) == ["x['c']"]


def test_module_paths_and_tied_weights():
    m = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4))
    m[1].weight = m[0].weight
    m.extra = {"cache": torch.zeros(3)}
    names = access_paths({"model": m})
    assert set(names) == {"model[0].weight", "model[1].bias", "model.extra['cache']"}


def test_tensor_dict_keys_are_named_by_their_path():
    lin = nn.Linear(2, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    names = access_paths({"opt": opt, "lin": lin})
    assert "opt.state[lin.weight]['momentum_buffer']" in names
    assert "opt.state[lin.bias]['momentum_buffer']" in names


def test_skips_modules_classes_functions_and_addresses():
    class Local:
        pass
    obj = Local()
    obj.t = torch.zeros(1)
    roots = {"os": os, "torch": torch, "Local": Local, "f": lambda: None, "__hidden": torch.zeros(1),
             "ns": types.SimpleNamespace(t=torch.zeros(2)), "keyed": {obj: torch.zeros(3)}, "o": obj}
    names = access_paths(roots)
    assert set(names) == {"ns.t", "o.t"}


def test_deterministic_across_calls():
    def build():
        return {"m": nn.Sequential(*[nn.Linear(3, 3) for _ in range(12)]), "kv": {f"layer_{i}": torch.zeros(1) for i in range(12)}}
    a = access_paths(build())
    b = access_paths(build())
    assert list(a) == list(b) and "m[11].weight" in a and "kv['layer_10']" in a
