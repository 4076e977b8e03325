"""Odd shapes and dtypes are refused with ``BadRequest`` naming the object and the field:
by the client before anything is sent, and by the daemon (which trusts no message), which
keeps serving.  Never a truncation (2.5 -> 2), never a raw ValueError/TypeError."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gpu_anchor
from gpu_anchor import errors
from gpu_anchor.client.channel import Channel

BAD = [  # (shape, dtype, field, what the message shows)
    ((4, 2.5), torch.float32, "shape[1]", "2.5 (float)"),
    ((4, 2.0), torch.float32, "shape[1]", "2.0 (float)"),
    (("4",), torch.float32, "shape[0]", "'4' (str)"),
    ((None, 3), torch.float32, "shape[0]", "None (NoneType)"),
    ((True,), torch.float32, "shape[0]", "True (bool)"),
    ((-1,), torch.float32, "shape[0]", "-1 (int)"),
    ((torch.tensor(2.0),), torch.float32, "shape[0]", "(Tensor)"),
    (4, torch.float32, "shape", "got 4"),
    (None, torch.float32, "shape", "got None"),
    ((4,), "float32", "dtype", "'float32' (str)"),
    ((4,), None, "dtype", "None (NoneType)"),
    ((4,), np.float32, "dtype", "(type)"),
]


@pytest.mark.parametrize("shape,dtype,field,shown", BAD, ids=[f"{b[2]}-{b[3]}" for b in BAD])
def test_client_refuses_before_sending(host_daemon, shape, dtype, field, shown):
    c = gpu_anchor.connect("cpu", namespace="bad-fields")
    requests = c.status()["requests"]
    with pytest.raises(errors.BadRequest) as e:
        c.tensor("layer.w", shape, dtype)
    assert e.value.details == {"field": field, "name": "layer.w"}, e.value.details
    assert f"'layer.w': {field}" in str(e.value) and shown in str(e.value), str(e.value)
    assert c.status()["requests"] == requests + 1, "the refused bind reached the daemon"
    assert c.names() == []


def test_client_accepts_every_integer_kind(host_daemon):
    c = gpu_anchor.connect("cpu", namespace="int-kinds")
    t = c.tensor("w", (np.int64(2), torch.tensor(3), torch.Size([4])[0]), torch.float16)
    assert t.shape == (2, 3, 4) and t.dtype == torch.float16
    assert c.tensor("v", torch.Size([5]), torch.int8).shape == (5,)


def test_a_bad_entry_refuses_the_whole_batch(host_daemon):
    c = gpu_anchor.connect("cpu", namespace="bad-batch")
    with pytest.raises(errors.BadRequest, match=r"objects\[1\] 'b': shape\[0\]"):
        c.bind([("a", (2,), torch.float32), ("b", (2.5,), torch.float32)])
    assert c.names() == []


DAEMON_BAD = [  # what a buggy or hostile client could put on the wire, and the field named
    ({"name": "w", "dtype": "float32", "shape": [4, 2.5]}, "shape[1]"),
    ({"name": "w", "dtype": "float32", "shape": [2.0]}, "shape[0]"),
    ({"name": "w", "dtype": "float32", "shape": ["4"]}, "shape[0]"),
    ({"name": "w", "dtype": "float32", "shape": [None]}, "shape[0]"),
    ({"name": "w", "dtype": "float32", "shape": [False]}, "shape[0]"),
    ({"name": "w", "dtype": "float32", "shape": [1e400]}, "shape[0]"),
    ({"name": "w", "dtype": "float32", "shape": "4"}, "shape"),
    ({"name": "w", "dtype": "float32", "shape": None}, "shape"),
    ({"name": "w", "dtype": "float32", "shape": {"0": 4}}, "shape"),
    ({"name": "w", "dtype": "float32"}, "shape"),
    ({"name": "w", "dtype": 7, "shape": [4]}, "dtype"),
    ({"name": "w", "dtype": None, "shape": [4]}, "dtype"),
    ({"name": "w", "dtype": "torch.float32", "shape": [4]}, "dtype"),
    ({"name": "w", "dtype": ["float32"], "shape": [4]}, "dtype"),
]


def test_daemon_refuses_bad_fields_and_keeps_serving(host_daemon):
    path, proc = host_daemon
    ch = Channel("cpu", path)
    for entry, field in DAEMON_BAD:
        objects = [{"name": "ok", "dtype": "uint8", "shape": [8]}, entry]
        with pytest.raises(errors.BadRequest) as e:
            ch.request({"op": "bind", "namespace": "wire", "objects": objects})
        assert e.value.details == {"field": field, "name": "w"}, (entry, e.value.details)
        assert f"bind: objects[1] 'w': {field}" in str(e.value), (entry, str(e.value))
    for entry, field in [({"name": 5, "dtype": "uint8", "shape": [1]}, "name"), ("w", "objects[0]")]:
        with pytest.raises(errors.BadRequest) as e:
            ch.request({"op": "bind", "namespace": "wire", "objects": [entry]})
        assert e.value.details["field"] == field, e.value.details
    assert proc.poll() is None
    assert ch.request({"op": "list", "namespace": "wire"})[0]["objects"] == []   # all-or-nothing
    reply = ch.request({"op": "bind", "namespace": "wire", "objects": [{"name": "w", "dtype": "float32",
                                                                          "shape": [4, 2]}]})[0]
    assert reply["results"][0]["status"] == "created"
    c = gpu_anchor.connect("cpu", namespace="wire")                  # and a real client still works
    assert c.tensor("w", (4, 2), torch.float32).shape == (4, 2)
