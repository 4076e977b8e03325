"""Linear layers whose weight gradient is written by its GEMM straight into the anchored buffer.

At a step's boundary every gradient must lie in its anchored buffer: the buffers are the redo
log of the step in flight (``grads``).  Torch's backward makes each gradient in memory of its
own, and ``GradientBuffers`` copies it home as it arrives: one read and one write of every
gradient byte, every step.  An ``nn.Linear`` weight's gradient is one GEMM,
``grad_output^T @ input``; here that GEMM writes into the buffer, and the copy is gone.  For an
LLM nearly every parameter byte is such a weight.

Contract (``StepProtocolConfig.grads_in_place``; by default on where it applies, ``config``):

- **Where.** Only with the fresh gradients of one process (``GradientBuffers.fresh``: no DDP
  across ranks, no FSDP2, ``zero_grad()`` freeing them), as gradient lending.  The layers are
  found at their calls during the first step after the optimizer is built (a global module
  pre-hook, removed at that ``step()``), and write in place from the next step on: a forward that
  ran torch's ``forward`` and that activation checkpointing computes again in the backward must
  save the same tensors the second time.  A layer is taken if its type is exactly ``nn.Linear``
  (a subclass may compute something else), its weight is one of the optimizer's anchored
  parameters, and it has no ``forward`` of its own already but this module's (accelerate's hooks
  put one there), and is not called inside a ``torch.compile``'d frame (whose graph makes its
  gradients itself).  A weight that a call of another module also holds (Llama's ``lm_head`` tied
  to the embedding) is not taken, and a layer taken for it is given back: autograd sums such a
  weight's gradients before accumulating them, so the GEMM's write would be copied anyway, and
  it would come at backward's start, where the copy comes at its end (the gradient lender plans
  its buffers by when gradients arrive).  Its ``forward`` becomes an instance method (``stats["modules"]``); a
  layer first called later keeps torch's, and if that first step took none, ``step()`` warns.
- **Which calls.**  Grad mode on, the weight requiring grad, an input that is a plain
  contiguous tensor of 2 or 3 dimensions with the weight's dtype and device, no autocast for it,
  no tracing (``torch.compile``, ``jit.trace``), no functorch transform.  Any other call is
  ``nn.Linear.forward`` itself.
- **Which backwards.**  The GEMM writes into the buffer only when the weight has no gradient yet
  (``p.grad`` is None: the first since ``zero_grad()``), the engine will accumulate into
  ``p.grad`` (``.backward()``, not ``autograd.grad``, which returns gradients instead; torch's
  ``_will_engine_execute_node`` says which), and the backward builds no graph
  (``create_graph``).  The gradient then reaches autograd as a fresh view of the buffer, which
  ``AccumulateGrad`` takes as ``p.grad`` without a copy; otherwise it is made as torch makes it
  and copied home as before.  A layer called twice in one backward has its first gradient
  written in place and its second made elsewhere (the two are summed before they are
  accumulated: the buffer must keep the first); one backward is one graph task.
- **The same bits.**  The forward is ``F.linear``; the backward runs what torch's autograd runs
  for a linear layer (``grad @ W`` for the input; ``grad^T @ x`` into an (out, in) row-major
  result for the weight; the bias's ``sum_to_size``), with the buffer as the weight's output.
  Tested bit for bit against ``nn.Linear`` on the CPU and on CUDA.
- **Nothing lent is overwritten.**  Before the GEMM the gradient lender moves any lent tensor
  still alive out of the buffer's bytes, as before a copy (``GradientLender.arrived``).
- **Held weakly.**  A patched layer holds the buffers through a weak reference: once the
  optimizer is gone its calls are ``nn.Linear.forward`` again (and a later optimizer over the
  same model takes it anew).  A copy of the model (``deepcopy``) and a
  pickled one hold no buffers: the method is named ``forward``, so pickle restores
  ``nn.Linear.forward``, and a copy's weight is not an anchored parameter.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

# patched module -> (weakref to its GradientBuffers, index of its weight among them)
_targets: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _functorch_active() -> bool:
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return level is not None and level() is not None


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))


def _qualifies(module: nn.Linear, x, target) -> bool:
    # per call, in about a microsecond: the weight's dtype and device were read when it was taken
    ref, index, dtype, device, live = target
    buffers, w, b = ref(), module.weight, module.bias
    return (live[0] and buffers is not None and buffers.params[index].p is w
            and torch.is_grad_enabled() and w.requires_grad
            and type(x) is torch.Tensor and x.dtype is dtype and x.get_device() == device and x.dim() in (2, 3)
            and x.is_contiguous() and (b is None or (type(b) in (torch.Tensor, nn.Parameter) and b.dtype is dtype
                                                     and b.dim() == 1))
            and not _any_autocast() and not torch._C._get_tracing_state() and not _functorch_active())


def forward(self, input):
    """``nn.Linear.forward``, with the weight's gradient written in place where it qualifies."""
    if not torch.compiler.is_compiling():      # first: a traced frame skips the lookups too
        target = _targets.get(self)
        if target is not None and _qualifies(self, input, target):
            return _Linear.apply(input, self.weight, self.bias, target)
    return nn.Linear.forward(self, input)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target):
        ctx.target, ctx.bias_shape = target, bias.shape if bias is not None else None
        # what torch's mm saves: the input for the weight's gradient, the weight for the input's
        ctx.save_for_backward(x, weight if ctx.needs_input_grad[0] else None)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x2, g2 = x.view(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        gx = g2.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        buffers = ctx.target[0]()
        out = buffers.in_place(ctx.target[1], ctx.next_functions[1][0]) if buffers is not None else None
        gw = g2.t().mm(x2) if out is None else torch.mm(g2.t(), x2, out=out)
        # autograd's engine reduces addmm's broadcast bias gradient with sum_to
        gb = g2.sum_to_size(ctx.bias_shape) if ctx.bias_shape is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


class _Discovery:
    """The global hook of the first step's forward; ``remove()`` (at that step's boundary) ends it
    and puts the layers it took to work."""

    def __init__(self, live: list) -> None:
        self.live, self.handle = live, None

    def remove(self) -> None:
        self.handle.remove()
        self.live[0] = True


def discover(buffers) -> _Discovery:
    """Takes the qualifying ``nn.Linear`` layers over ``buffers``' parameters as they are called
    in the first step; they write in place once ``remove()`` is called at its boundary.  Not at
    once: a forward begun before a layer was taken runs torch's ``forward`` for it, and where
    activation checkpointing computes that forward again in the backward, the second run must
    save what the first did (``torch.utils.checkpoint`` compares them)."""
    ref, live = weakref.ref(buffers), [False]
    found = _Discovery(live)
    index = {id(q.p): q.index for q in buffers.params if q.p.requires_grad}
    holder: dict[int, int] = {}         # parameter -> the first module seen calling with it
    taken: dict[int, list] = {}         # parameter -> the layers taken for it

    def pre_hook(module, args):
        if torch.compiler.is_compiling():
            return
        b = ref()
        if b is None:
            return
        for p in module._parameters.values():
            if p is not None and id(p) in index and holder.setdefault(id(p), id(module)) != id(module):
                # tied (an embedding's weight as lm_head's): its gradients are summed before they
                # are accumulated, so a GEMM writing one of them in place saves nothing
                for layer in taken.pop(id(p), ()):
                    _restore(weakref.ref(layer), ref)
                    b.stats["modules"] -= 1
                index.pop(id(p))
        own = module.__dict__.get("forward")
        if (type(module) is not nn.Linear or (own is not None and getattr(own, "__func__", None) is not forward)
                or _targets.get(module, (None,))[0] is ref):       # another's forward, or taken already
            return
        i, w = index.get(id(module.weight)), module.weight
        if i is None or b.params[i].p is not w or min(w.shape) < 2:
            return
        _targets[module] = (ref, i, w.dtype, w.get_device(), live)
        module.forward = forward.__get__(module)
        taken.setdefault(id(w), []).append(module)
        b.stats["modules"] += 1
        weakref.finalize(b, _restore, weakref.ref(module), ref)

    found.handle = nn.modules.module.register_module_forward_pre_hook(pre_hook)
    # an optimizer gone before its first step must not leave every module call of the process on
    # nn.Module's slow path
    weakref.finalize(buffers, found.handle.remove)
    return found


def _restore(module_ref, buffers_ref) -> None:
    """Torch's ``forward`` back on the layer, unless another optimizer's buffers took it since."""
    module = module_ref()
    if module is not None and _targets.get(module, (None,))[0] is buffers_ref:
        del module.__dict__["forward"]
        del _targets[module]
