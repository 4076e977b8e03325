"""The anchored gradients between steps: what ``p.grad`` is, and which parameters a step updates.

Each parameter's gradient lives in an anchored buffer (``q.grad``; ``q.gview`` is it seen as
``p`` is, a DTensor under FSDP2): at the step's boundary the buffers must hold this step's
final gradients, because they are the redo log of the step in flight.

- ``fresh`` (one process, plain tensors): ``zero(cleared=True)`` — torch's default
  ``zero_grad()`` — leaves ``p.grad`` None, as torch does, and touches no buffer; backward
  makes a gradient and the parameter's post-accumulate hook copies it home at once (``p.grad``
  then points at the buffer, and later micro-batches accumulate into it).  One copy per
  gradient, where zeroing the buffer and accumulating into it costs a write and a
  read-modify-write (``bench train_overhead``: plain ``AdamW(fused=True)`` keeping its
  gradients is 0.7–3.3 % slower on the H200).
- otherwise (DDP's buckets and FSDP2's sharded gradients own ``p.grad``'s life), and with
  ``zero(cleared=False)``: the buffers are zeroed in place and ``p.grad`` keeps pointing at them.

With ``in_place`` (``fresh`` only), the weight gradients of ``nn.Linear`` layers are written into
their buffers by the GEMM that makes them (``grads_in_place``); the hook then finds ``p.grad``
already home.  ``stats`` counts gradients written in place and copied home.

Either way the buffers keep the last step's gradients until the next backward writes them, or,
with a ``grad_lending.GradientLender`` (``fresh`` only), until ``zero(cleared=True)`` lends them
to the next forward's saved activations: nothing here clears a redo log before the step it
belongs to is written.  ``finalize`` is the boundary: a parameter whose tensor was replaced since (moved out of
anchored memory) is refused; a gradient found elsewhere (a framework replaced ``p.grad``) is
copied home; the mask says which parameters got one since
the last ``zero`` — the step skips the others, as torch skips ``grad is None``.
"""
from __future__ import annotations

import warnings
import weakref

import torch

from . import grads_in_place
from .fsdp import local as _local


class GradientBuffers:
    def __init__(self, params, fresh: bool, lender=None, in_place: bool = False, quiet: bool = False) -> None:
        if lender is not None and not fresh:
            raise ValueError("gradient lending needs the fresh gradients of one process")
        if in_place and not fresh:
            raise ValueError("gradients written in place need the fresh gradients of one process")
        self.params, self.fresh, self.lender = params, fresh, lender
        self._quiet = quiet     # in place by the automatic choice: a first step that took no layer is no news
        self.cleared = [True] * len(params)
        self.stats = {"in_place": 0, "copied": 0, "modules": 0}
        self._given: dict[int, int] = {}      # parameter -> the backward (graph task) its buffer went to
        assert all(q is params[q.index] for q in params)
        self.hooks = [q.p.register_post_accumulate_grad_hook(self._hook(q)) for q in params if q.p.requires_grad]
        # the layers are found during the first forward; the global hook goes at the first step
        self._discovering = grads_in_place.discover(self) if in_place else None

    def zero(self, cleared: bool = True) -> None:
        if cleared and self.fresh:
            for q in self.params:
                q.p.grad = None
            if self.lender is not None:
                self.lender.open()
        else:
            if self.lender is not None:
                self.lender.close()
            torch._foreach_zero_([q.grad for q in self.params])
            for q in self.params:
                if q.p.grad is None or _local(q.p.grad).data_ptr() != q.grad.data_ptr():
                    q.p.grad = q.gview
        self.cleared = [cleared] * len(self.params)

    def finalize(self) -> list[bool]:
        """The gradient-finalization boundary: the buffers hold the final gradients; returns
        which parameters got one."""
        if self._discovering is not None:
            self._discovering.remove()
            self._discovering = None
            if not self.stats["modules"] and not self._quiet:
                warnings.warn("gpu_anchor: StepProtocolConfig.grads_in_place writes no gradient in place: the "
                              "first step's forward called no nn.Linear layer (of exactly that type, outside "
                              "torch.compile, its weight not tied to another module) over the optimizer's "
                              "parameters; their gradients are copied home as without it",
                              RuntimeWarning, stacklevel=4)
        if self.lender is not None:
            self.lender.finalize()
        mask = []
        for q in self.params:
            if _local(q.p).data_ptr() != q.flat.data_ptr():
                raise RuntimeError(
                    f"parameter {q.name!r} no longer lies in the anchored memory the optimizer updates: its "
                    "tensor was replaced after AnchoredOptimizer was built (a .to()/.cuda(), or a framework "
                    "placing the model on its device, copies it), so the step would update memory the model no "
                    "longer reads. Move the model before building the optimizer, inside the scope"
                    + (f"; on the CPU a move to {_local(q.p).device} copies even a model already there: turn the "
                       "framework's placement off (accelerate: Accelerator(device_placement=False))"
                       if _local(q.p).device.type == "cpu" and _local(q.p).device.index is not None else "") + ".")
            g = q.p.grad
            if g is None:
                q.p.grad = q.gview
                mask.append(False)
            elif _local(g).data_ptr() != q.grad.data_ptr():
                q.grad.copy_(_local(g))      # someone replaced p.grad: bring it home
                self.stats["copied"] += 1
                q.p.grad = q.gview
                mask.append(True)
            else:
                mask.append(not self.cleared[q.index])
        return mask

    def _hook(self, q):
        # Weak: a parameter's hooks live in autograd's C++ state, which the collector does not
        # see, so a hook holding these buffers (or the parameter) would keep the parameters,
        # gradients and optimizer state mapped, descriptors included, after the optimizer is gone.
        ref, i = weakref.ref(self), q.index

        def hook(p):
            buffers = ref()
            if buffers is not None:
                buffers._arrived(buffers.params[i], p)
        return hook

    def _arrived(self, q, p) -> None:
        self.cleared[q.index] = False
        g = p.grad
        if self.fresh and g is not None and g.data_ptr() != q.grad.data_ptr():
            if self.lender is not None:
                self.lender.arrived(q)
            q.grad.copy_(g)          # this backward's gradient: home now, its buffer freed
            p.grad = q.gview
            self.stats["copied"] += 1

    def in_place(self, index: int, accumulator) -> "torch.Tensor | None":
        """A fresh view of parameter ``index``'s buffer for its gradient's GEMM to write into, or
        None: the gradient is made elsewhere (``grads_in_place``).  ``accumulator``: the
        parameter's ``AccumulateGrad`` node in the running backward."""
        q = self.params[index]
        if q.p.grad is not None or torch.is_grad_enabled():
            return None            # a later micro-batch accumulates; create_graph builds a graph
        task = torch._C._current_graph_task_id()
        if self._given.get(index) == task:
            # a second gradient of this weight in this backward (a layer called twice): autograd
            # sums the two before accumulating, so the buffer already holds the first
            return None
        try:
            if not torch._C._will_engine_execute_node(accumulator):
                return None        # a backward(inputs=...) that leaves this parameter out
        except RuntimeError:
            return None            # autograd.grad(): the gradient is returned, not accumulated
        if self.lender is not None:
            self.lender.arrived(q)
        self._given[index] = task
        self.stats["in_place"] += 1
        return q.grad.view(q.p.shape)
