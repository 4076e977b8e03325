"""What gradient lending knows of its model's forward and backward, and what it lends next
(``grad_lending``; bookkeeping only: no hooks, no copies).

- **Candidates** are numbered in the order a window first sees them, from where the
  saved-tensor hooks went on; ``sizes`` and ``calls_at`` (the module call each came in) by
  number.  A window on the global hooks records both (``record``); a targeted window, which
  counts no module calls, maps the i-th candidate it sees to the learnt one ``expect[i]``
  (``expected``).
- **The learnt forward** (``learn``, from a learning window): by module call, the module and its
  n-th call in the window; the outermost module (the *root*) if there was one; and each save
  of a candidate with its call, from which ``target`` finds the *mark* (the module call where
  the first chosen candidate came) and ``expect`` (the candidates a window sees from there, each
  by the first of its saves from that call on: a tensor saved before it and again after is
  seen).
- **The plan** (``replan``): from the forward's last candidate back, each that still fits the
  budget and the largest area, and was not ``held`` (its original outlived the forward).
- **Areas**: runs of gradient buffers that touch end to end, ordered so that those whose first
  gradient arrived last in the previous backward come first (``order``); ``place`` bumps.
"""
from __future__ import annotations

import weakref

import torch

from .lent_memory import _Area, _areas

ALIGN = 512                # as the daemon's arena and torch's allocator align


class ForwardPlan:
    """See the module docstring.  ``params``: ``layout.AnchoredParam`` records (``q.grad`` set)."""

    def __init__(self, params) -> None:
        self.params = params
        self.sizes: list[int] = []
        self.calls_at: list[int] = []
        self.chosen: set[int] | None = None     # the candidates to lend (None: learning)
        self.held: set[int] = set()             # candidates whose original outlived the forward
        self.order: list[int] | None = None     # parameter indices, by arrival in the last backward
        self.root = None                        # weakref to the learnt forward's outermost module
        self.call_log: list = []                # by module call: (weakref to the module, its n-th call)
        self.save_log: list = []                # (call, candidate) of each save of a candidate
        self.expect: list[int] = []             # a targeted window: the learnt candidates it sees, in order
        self.drifts = 0                         # targeted windows in a row that saw other candidates
        self._areas: list[_Area] | None = None

    # ------------------------------------------------------------------ candidates
    def record(self, i: int, n: int, call: int) -> int:
        """Candidate ``i`` (global hooks' numbering) is ``n`` bytes, seen in module call ``call``."""
        if i < len(self.sizes):
            self.sizes[i], self.calls_at[i] = n, call
        else:
            self.sizes.append(n)
            self.calls_at.append(call)
        return i

    def expected(self, i: int, n: int) -> int | None:
        """The learnt candidate a targeted window's ``i``-th is, now ``n`` bytes; None past the
        learnt ones (the forward changed)."""
        if i >= len(self.expect):
            return None
        k = self.expect[i]
        self.sizes[k] = n
        return k

    def trim(self, seen_end: int) -> None:
        del self.sizes[seen_end:], self.calls_at[seen_end:]      # fewer candidates now, maybe

    def push_call(self) -> int:
        """The module call where the first chosen candidate came (0: learning, the outermost)."""
        return self.calls_at[min(self.chosen)] if self.chosen else 0

    # ------------------------------------------------------------------ the learnt forward
    def learn(self, modules: list, root, saves: list) -> None:
        """A learning window's module calls, its outermost module (None, or False: several) and
        its saves of candidates.  After two windows in a row that drifted, no root: the global
        hooks stay."""
        # (a module's truth is its len() where it has one: torch.compile's wrapper refuses it)
        self.root = weakref.ref(root) if isinstance(root, torch.nn.Module) and self.drifts < 2 else None
        nth: dict = {}
        self.call_log = []
        for m in modules:
            nth[m] = nth.get(m, 0) + 1
            self.call_log.append((weakref.ref(m), nth[m]))
        self.save_log = saves

    def target(self):
        """``(root, mark, n)``: the modules a lending window hooks and the mark's call in the
        window where the saved-tensor hooks go on, with ``expect`` set; None where the plan is
        empty, the learnt forward had several outermost modules, or a module is gone."""
        if not self.chosen or self.root is None:
            return None
        call = self.push_call()
        if not 0 < call <= len(self.call_log):
            return None
        mark, nth = self.call_log[call - 1]
        root, mark = self.root(), mark()
        if root is None or mark is None:
            return None
        self.expect = list(dict.fromkeys(k for c, k in self.save_log if c >= call))
        return root, mark, nth

    # ------------------------------------------------------------------ the plan
    def arrived_in(self, arrivals: list[int]) -> None:
        """This backward's arrival order (the parameters that got no gradient last)."""
        arrivals = list(dict.fromkeys(arrivals))     # a gradient written in place, then copied: once
        seen = set(arrivals)
        order = arrivals + [q.index for q in self.params if q.index not in seen]
        if order != self.order:
            self.order, self._areas = order, None

    def replan(self, budget: int) -> set[int]:
        """The candidates to lend, by the sizes seen: from the forward's last one back, each that
        still fits the budget.  One too large (the logits, say) is passed over, not an end: the
        ones before it fill what is left.  ``place`` puts them in forward order, so the earlier
        ones, which backward frees last, take the areas whose gradients arrive last."""
        largest = self.largest_area()
        total, chosen = 0, set()
        for k in range(len(self.sizes) - 1, -1, -1):
            n = self.sizes[k]
            if n > largest or k in self.held or total + n > budget:
                continue
            total += n
            chosen.add(k)
        self.chosen = chosen
        return chosen

    def idle_reason(self, budget: int, min_bytes: int) -> str:
        """Why a plan came out empty."""
        sizes = [n for k, n in enumerate(self.sizes) if k not in self.held]
        if not sizes:
            return f"the forward saves no tensor of {min_bytes} bytes or more that it does not return"
        return (f"none of its {len(sizes)} candidates fits: the smallest is {min(sizes)} bytes, the budget "
                f"{budget} (lend_grad_bytes less what gradients had to move out) and the largest run of "
                f"gradient buffers {self.largest_area()}")

    # ------------------------------------------------------------------ areas
    def ordered_areas(self) -> list[_Area]:
        """Areas whose first gradient arrives last come first: the tail of the forward, which
        backward reads first, goes where gradients arrive last."""
        if self._areas is None:
            rank = {i: r for r, i in enumerate(self.order or ())}
            self._areas = sorted(_areas(self.params), key=lambda a: -min(rank.get(q.index, 0) for q in a.params))
        return self._areas

    def largest_area(self) -> int:
        return max((a.end - a.base for a in self.ordered_areas()), default=0)

    def reset_areas(self) -> None:
        for a in self._areas or ():
            a.top = a.base

    def place(self, n: int):
        """``(area, address)`` for ``n`` bytes in the first area with room, or None."""
        for a in self.ordered_areas():
            start = (a.top + ALIGN - 1) // ALIGN * ALIGN
            if start + n <= a.end:
                a.top = start + n
                return a, start
        return None

    def aliases(self, ptr: int) -> bool:
        return any(a.base <= ptr < a.end for a in self._areas or ())
