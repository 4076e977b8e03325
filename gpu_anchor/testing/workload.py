"""A deterministic training job over anchored memory, for tests and benchmarks.

An MLP whose parameters and Adam moments are anchored objects of one client's
namespace; the committed step lives in the journal (``gpu_anchor/step`` = the last
finished step).  Two optimizer placements:

* ``in_backward=False`` — a foreach Adam after backward (``_foreach_*_`` ops: write
  sets come from the schema's tensor lists);
* ``in_backward=True`` — a per-parameter Adam in ``register_post_accumulate_grad_hook``
  (the optimizer fused into backward: breaks the training protocol's "gradients
  finalised before the step" assumption, so it needs the generic guard).

``undeclared=True`` starts every step with a custom op whose schema says it writes
nothing but which scales its input in place — the last Adam moment by name, i.e. the
object the copier reaches last (the validation test's culprit).  Inputs of step ``s``
depend only on ``(seed, s)``, so any run that reaches step ``s`` from the same state
computes the same bits.
"""
from __future__ import annotations

import torch

from gpu_anchor.journal_keys import STEP_KEY
from gpu_anchor.train.anchor import anchor_module

_LIB = None


def undeclared_scale_op():
    """``gpu_anchor_test::shrink(Tensor x, float a) -> Tensor``: mutates ``x`` but does not declare it."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("gpu_anchor_test", "DEF")
        _LIB.define("shrink(Tensor x, float a) -> Tensor")

        def shrink(x, a):
            x.mul_(a)  # the undeclared write
            return x.new_empty(())

        _LIB.impl("shrink", shrink, "CPU")
        _LIB.impl("shrink", shrink, "CUDA")
    return torch.ops.gpu_anchor_test.shrink.default


class Job:
    def __init__(self, client, hidden: int = 32, layers: int = 3, batch: int = 16, seed: int = 0,
                 in_backward: bool = False, undeclared: bool = False, lr: float = 1e-2, hook=None) -> None:
        self.client, self.seed, self.batch, self.hidden, self.lr = client, seed, batch, hidden, lr
        self.device = torch.device(client.device)
        torch.manual_seed(seed)  # seeds the CUDA generators too
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(hidden, hidden, device=self.device), torch.nn.Tanh()]
        self.model = torch.nn.Sequential(*mods[:-1])  # initialised on the device: fast at 1B
        anchor_module(self.model, client, prefix="model")
        self.params = dict(self.model.named_parameters())
        specs = [(f"optim.{n}.{k}", tuple(p.shape), p.dtype) for n, p in self.params.items()
                 for k in ("exp_avg", "exp_avg_sq")]
        bound = client.bind(specs)
        with torch.no_grad():
            for b in bound:
                if b.status == "created":
                    b.tensor.zero_()
        self.state = {b.name: b.tensor for b in bound}
        self.undeclared = undeclared_scale_op() if undeclared else None
        self.in_backward = in_backward
        self.hook = hook  # called inside every per-parameter update (tests: widen kill windows)
        self._step_no = 0
        if in_backward:
            for n, p in self.params.items():
                p.register_post_accumulate_grad_hook(lambda p, n=n: self._update_one(n, p))

    # ------------------------------------------------------------------ state
    def committed_step(self) -> int:
        v = self.client.journal.get(STEP_KEY)
        return int(v) if v is not None else 0

    def commit(self, step: int, puts: dict | None = None) -> None:
        self.client.journal.commit({STEP_KEY: b"%d" % step, **(puts or {})})

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"model.{n}": p.detach() for n, p in self.params.items()}
        out.update(self.state)
        return out

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Host copies of every anchored tensor of the job (for bit-for-bit comparisons)."""
        return {n: t.detach().to("cpu", copy=True) for n, t in self.tensors().items()}

    # ------------------------------------------------------------------ training
    def data(self, step: int):
        g = torch.Generator().manual_seed(self.seed * 100003 + step)
        x = torch.randn(self.batch, self.hidden, generator=g)
        y = torch.randn(self.batch, self.hidden, generator=g)
        return x.to(self.device), y.to(self.device)

    def step(self, step: int) -> float:
        """Run step ``step`` (1-based: the first step after a fresh start is 1)."""
        self._step_no = step
        if self.undeclared is not None:  # first thing in the step, on the object copied last
            self.undeclared(self.state[sorted(self.state)[-1]], 0.999)
        x, y = self.data(step)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        if not self.in_backward:
            self._update_all()
        return float(loss.detach())

    def _adam(self, step: int):
        b1, b2 = 0.9, 0.999
        return b1, b2, 1 - b1 ** step, 1 - b2 ** step

    def _update_all(self) -> None:
        b1, b2, c1, c2 = self._adam(self._step_no)
        ps = list(self.params.values())
        names = list(self.params)
        grads = [p.grad for p in ps]
        m = [self.state[f"optim.{n}.exp_avg"] for n in names]
        v = [self.state[f"optim.{n}.exp_avg_sq"] for n in names]
        with torch.no_grad():
            torch._foreach_lerp_(m, grads, 1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, 1 - b2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, c2 ** 0.5)
            torch._foreach_add_(denom, 1e-8)
            torch._foreach_addcdiv_(ps, m, denom, -self.lr / c1)
        for p in ps:
            p.grad = None

    def _update_one(self, name: str, p: torch.Tensor) -> None:
        b1, b2, c1, c2 = self._adam(self._step_no)
        m, v = self.state[f"optim.{name}.exp_avg"], self.state[f"optim.{name}.exp_avg_sq"]
        with torch.no_grad():
            g = p.grad
            m.lerp_(g, 1 - b1)
            if self.hook is not None:
                self.hook(name)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / c2 ** 0.5).add_(1e-8)
            p.addcdiv_(m, denom, value=-self.lr / c1)
        p.grad = None
