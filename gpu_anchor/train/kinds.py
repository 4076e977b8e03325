"""What each supported torch optimizer keeps per parameter, and how one chunk is applied.

A chunk is applied by calling the wrapped optimizer's own functional implementation
(``torch.optim.adam.adam`` / ``torch.optim.sgd.sgd``, the functions its ``step`` calls)
on the chunk's slices, with the group's hyper-parameters (``foreach``/``fused``
included).  Their updates are elementwise, so slicing a parameter does not change a
single bit of the result.
"""
from __future__ import annotations

import torch
from torch.optim import SGD, Adam
from torch.optim.adam import adam
from torch.optim.sgd import sgd


class Kind:
    name = "?"
    has_step = False       # per-parameter step counter (Adam's ``state['step']``)

    def state_keys(self, group: dict) -> list[str]:
        raise NotImplementedError

    def apply(self, params, grads, states, counts, steps, hp: dict) -> list[tuple[int, str, torch.Tensor]]:
        """Update in place; returns state tensors the optimizer replaced (to copy back)."""
        raise NotImplementedError


class AdamKind(Kind):
    name = "adam"
    has_step = True

    def state_keys(self, group):
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])

    def apply(self, params, grads, states, counts, steps, hp):
        beta1, beta2 = hp["betas"]
        adam(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
             [s["max_exp_avg_sq"] for s in states] if hp["amsgrad"] else [], steps,
             amsgrad=hp["amsgrad"], has_complex=any(torch.is_complex(p) for p in params),
             beta1=beta1, beta2=beta2, lr=hp["lr"], weight_decay=hp["weight_decay"], eps=hp["eps"],
             maximize=hp["maximize"], foreach=hp["foreach"], capturable=hp["capturable"],
             differentiable=hp["differentiable"], fused=hp["fused"],
             decoupled_weight_decay=hp.get("decoupled_weight_decay", False))
        return []


class SGDKind(Kind):
    name = "sgd"

    def state_keys(self, group):
        return ["momentum_buffer"] if group["momentum"] != 0 else []

    def apply(self, params, grads, states, counts, steps, hp):
        momentum = hp["momentum"] != 0
        # torch starts a momentum buffer as clone(grad) on a parameter's first step:
        # give it no buffer then, and copy the one it makes into anchored memory.
        bufs = [s["momentum_buffer"] if momentum and c > 0 else None for s, c in zip(states, counts)]
        sgd(params, grads, bufs, weight_decay=hp["weight_decay"], momentum=hp["momentum"], lr=hp["lr"],
            dampening=hp["dampening"], nesterov=hp["nesterov"], maximize=hp["maximize"],
            has_sparse_grad=False, foreach=hp["foreach"], fused=hp["fused"])
        if not momentum:
            return []
        return [(i, "momentum_buffer", b) for i, (b, c) in enumerate(zip(bufs, counts)) if c == 0]


class LegacyAdamWKind(AdamKind):
    """torch < 2.9, where AdamW is its own class with its own functional."""

    def apply(self, params, grads, states, counts, steps, hp):
        from torch.optim.adamw import adamw
        beta1, beta2 = hp["betas"]
        adamw(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [s["max_exp_avg_sq"] for s in states] if hp["amsgrad"] else [], steps,
              amsgrad=hp["amsgrad"], has_complex=any(torch.is_complex(p) for p in params),
              beta1=beta1, beta2=beta2, lr=hp["lr"], weight_decay=hp["weight_decay"], eps=hp["eps"],
              maximize=hp["maximize"], foreach=hp["foreach"], capturable=hp["capturable"],
              differentiable=hp["differentiable"], fused=hp["fused"])
        return []


_settled: set = set()


def settle_cpu_sqrt(dtypes) -> None:
    """Have oneMKL pick its ``sqrt`` kernel for each float dtype on this thread alone, once.

    On the CPU, torch takes a float32 / float64 ``sqrt`` to oneMKL's VML, which picks a
    function's kernel at its first call.  When that first call runs on several intra-op threads
    at once, one thread can run a low-accuracy kernel over its whole share of the tensor
    (pytorch/pytorch#188792: oneMKL 2024.2, which torch's wheels bundle; not seen there with
    oneMKL 2025).  A restarted worker's recovery makes exactly that first call: it redoes the
    interrupted step's Adam update before anything in the process took a square root, and the
    update then differs from the fault-free one in the low bits of one thread's share (on this
    project's 2-core CI machine: the second half of an embedding's 4 096 elements, in 11 of 250
    kill-and-rerun runs).  A one-element ``sqrt`` runs on this thread only, and settles it.
    """
    for dtype in dtypes:
        if dtype in (torch.float32, torch.float64) and dtype not in _settled:
            torch.ones(1, dtype=dtype).sqrt()
            _settled.add(dtype)


def kind_of(optimizer: torch.optim.Optimizer) -> Kind:
    if isinstance(optimizer, torch.optim.AdamW) and not issubclass(torch.optim.AdamW, Adam):
        return LegacyAdamWKind()
    if isinstance(optimizer, Adam):       # AdamW is an Adam subclass in torch >= 2.9
        return AdamKind()
    if isinstance(optimizer, SGD):
        return SGDKind()
    raise TypeError(f"AnchoredOptimizer supports torch.optim.Adam, AdamW and SGD, not {type(optimizer).__name__}")
