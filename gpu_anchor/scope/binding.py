"""Binding: ask each device's daemon to match / create / refuse every named store, then
swap the placeholders for real tensors over the bound memory.

- One client per (process, device, namespace, socket) is cached for the process.
- Every device is asked with ``lookup`` first (on a fully-matching restart that is the
  only round trip).  ``on_conflict="error"``: any conflict on any device refuses the
  whole bind (``ConflictError`` naming each object and both shapes/dtypes) before
  anything is created, and the daemons' data is untouched.  ``"replace"``: conflicting
  objects are freed and recreated.
- The *unfilled* marker (journal key ``scope/unfilled``) lists objects created but not
  yet filled by their recipes, so a worker that dies in between does not leave garbage
  that the next worker would match.
- Swap: every live placeholder (found by reference count; autograd views first) becomes,
  in place, the corresponding view of the real allocation — ``torch.utils.swap_tensors``'
  mechanism, carrying tensor hooks over; ``nn.Parameter``-ness, ``requires_grad`` and user
  attributes are kept.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from gpu_anchor.errors import ConflictError, DaemonUnavailable
from gpu_anchor.paths import default_socket

from .placeholders import OWN_ATTRS, Placeholder, Store, real_view

_clients: dict[tuple, object] = {}
_why: dict[str, str] = {}     # device -> why the last client_for() found no daemon there


def client_for(device: str, namespace: str | None):
    """The process's client for ``device`` (None when no daemon answers there; see :func:`why_not`)."""
    from gpu_anchor.client.client import connect, default_namespace, namespace_for
    ns = namespace_for(namespace, device) if namespace is not None else default_namespace(device)
    sock = os.environ.get("GPU_ANCHOR_SOCKET") or default_socket(device)
    key = (os.getpid(), device, ns, sock)
    client = _clients.get(key)
    if client is not None:
        return client
    if device != "cpu" and not torch.cuda.is_available():
        _why[device] = f"no daemon for {device}: CUDA is not available in this process"
        return None
    try:
        client = connect(device, namespace=namespace)
    except (DaemonUnavailable, ConnectionError, FileNotFoundError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        _why[device] = (f"no daemon answers for {device} at {sock} ({first}); start one with "
                        f"`gpu-anchor daemon --device {device} --detach`")
        return None
    _clients[key] = client
    return client


def why_not(device: str) -> str:
    return _why.get(device, f"no daemon answers for {device}")


def forget_clients() -> None:
    """Drop cached clients (tests that stop daemons between scopes)."""
    _clients.clear()


UNFILLED = "scope/unfilled"


def bind(stores_by_client: dict, on_conflict: str) -> list[dict]:
    """Bind every store; sets ``store.real`` and ``store.status``; returns the conflicts seen.

    Per device: read the *unfilled* marker (objects a previous worker created but may not
    have finished filling), ``lookup`` every name (one round trip; on a full match this is
    the only one), write the marker for the names about to be created, then create them.
    A matched name listed in the marker is reported ``created`` so that its recipe is
    replayed again.  :func:`mark_filled` clears the marker once the replay is done.
    """
    plans = []
    conflicts: list[dict] = []
    for c, stores in stores_by_client.items():
        specs = [(s.name, s.alloc_spec()[0], s.dtype) for s in stores]
        unfilled = set(json.loads(c.journal.get(UNFILLED) or b"[]"))
        try:
            found = c.bind(specs, "lookup")
            clash = []
        except ConflictError as e:
            found, clash = None, e.conflicts or [{"name": "?", "message": str(e)}]
            conflicts.extend(clash)
        plans.append((c, stores, specs, unfilled, found, clash))
    if conflicts and on_conflict == "error":
        raise _conflict_error(conflicts)
    for c, stores, specs, unfilled, found, clash in plans:
        if found is not None and all(b.status == "matched" for b in found):
            results = found                                   # the common restart: nothing to create
        else:
            if found is not None:
                fresh = {b.name for b in found if b.status != "matched"}
            else:
                present = set(c.objects())
                fresh = {s.name for s in stores if s.name not in present} | {x.get("name") for x in clash}
            c.journal.put(UNFILLED, json.dumps(sorted(unfilled | fresh)).encode())
            results = c.bind(specs, "replace" if clash else "match_or_create")
        for s, b in zip(stores, results):
            s.real, s.status = b.tensor, b.status
            if b.status == "matched" and s.name in unfilled:
                s.status = "created"                          # a previous worker died before filling it
    return conflicts


def mark_filled(client, filled: set[str], puts: dict | None = None) -> None:
    """After the replay: drop ``filled`` from the unfilled marker (names another scope of the
    program still has to fill stay listed) and write ``puts``, in one commit."""
    puts = dict(puts or {})
    rest = set(json.loads(client.journal.get(UNFILLED) or b"[]")) - filled
    if rest:
        puts[UNFILLED] = json.dumps(sorted(rest)).encode()
    client.journal.commit(puts, deletes=[] if rest else [UNFILLED])


def _conflict_error(conflicts: list[dict]) -> ConflictError:
    lines = [f"  {c.get('name')}: anchored as {c.get('have')}, this program wants {c.get('want')}" for c in conflicts]
    return ConflictError(
        "managed_scope refused to bind (on_conflict='error'); the anchored data was left untouched:\n"
        + "\n".join(lines) + "\nUse managed_scope(on_conflict='replace') to recreate these objects, "
        "or `gpu-anchor drop NAMESPACE` to start the job afresh.", conflicts=conflicts)


def live_placeholders(stores: list[Store]) -> dict[Store, list[Placeholder]]:
    """Placeholders that something besides our lists still references, grouped by the store
    they are over *now* (``.data =`` and ``swap_tensors`` can move one to another store)."""
    out: dict[Store, list[Placeholder]] = {}
    for store in stores:
        lst = store.tensors
        for i in range(len(lst)):
            t = lst[i]
            # references: the list slot, the local ``t``, getrefcount's argument
            if sys.getrefcount(t) > 3:
                out.setdefault(t._ga_store, []).append(t)
            del t
    return out


def swap(t: torch.Tensor, new: torch.Tensor) -> None:
    """``torch.utils.swap_tensors`` without its use-count check, carrying tensor hooks over.

    The extra references a placeholder's impl may have are autograd views of it (other
    placeholders, swapped too) — nothing that will run on the old impl again.  Hooks
    (``register_hook``, ``register_post_accumulate_grad_hook``, e.g. by an optimizer
    wrapper built inside the scope) live with the impl, so they are re-registered."""
    # Weak references (``RNNBase._flat_weight_refs``) refer to the Python object, which keeps its
    # identity here: after the swap they reach the real tensor, as they should.
    post = t._post_accumulate_grad_hooks
    pre = t._backward_hooks
    t.__class__, new.__class__ = new.__class__, t.__class__
    t.__dict__, new.__dict__ = new.__dict__, t.__dict__
    torch._C._swap_tensor_impl(t, new)
    if post:
        t._post_accumulate_grad_hooks = post
    if pre:
        t._backward_hooks = pre


def swap_native(ph: Placeholder, real: torch.Tensor) -> None:
    """Turn placeholder ``ph`` into the native tensor ``real``, in place; it leaves its store."""
    lst = ph._ga_store.tensors
    for i in range(len(lst)):
        if lst[i] is ph:
            del lst[i]
            break
    attrs = {k: v for k, v in ph.__dict__.items() if k not in OWN_ATTRS}
    swap(ph, real)
    ph.__dict__.update(attrs)


def become_placeholder(t: torch.Tensor, ph: Placeholder) -> torch.Tensor:
    """``t.data = ph`` for a native ``t``: ``t`` becomes a placeholder over ``ph``'s store with
    ``ph``'s geometry, in place (its identity, ``Parameter``-ness and attributes kept).
    Returns a tensor object that now holds ``t``'s former native data."""
    new = Placeholder(ph._ga_store, ph._ga_meta, requires_grad=t.requires_grad)
    if isinstance(t, torch.nn.Parameter):
        new._is_param = True
    attrs = dict(t.__dict__)
    swap_placeholder_objects(t, new)
    for k, v in attrs.items():
        t.__dict__.setdefault(k, v)
    return new


def swap_placeholder_objects(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``torch.utils.swap_tensors`` when a placeholder is involved, keeping each store's list of
    the Python objects that are its placeholders right."""
    for t in (t1, t2):
        if isinstance(t, Placeholder):
            lst = t._ga_store.tensors
            for i in range(len(lst)):
                if lst[i] is t:
                    del lst[i]
                    break
    swap(t1, t2)
    for t in (t1, t2):
        if isinstance(t, Placeholder):
            t._ga_store.tensors.append(t)


def swap_in(live: list[Placeholder], base: torch.Tensor) -> int:
    """Turn the live placeholders ``live`` (over one store) into real views of ``base``."""
    live.sort(key=lambda t: not t._is_view())  # autograd views first: they hold their base
    n = 0
    for t in live:
        view = real_view(base, t._ga_meta)
        if t.__dict__.get("_is_param", False):
            new = torch.nn.Parameter(view, requires_grad=t.requires_grad)
        else:
            new = view.detach()
            if t.requires_grad:
                new.requires_grad_(True)
        for k, v in t.__dict__.items():
            if k not in OWN_ATTRS:
                new.__dict__[k] = v
        swap(t, new)
        del new
        n += 1
    live.clear()
    return n
