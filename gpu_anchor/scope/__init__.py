"""Anchor the state a ``with`` block builds: placeholders, recipes, naming, binding.

Public: :func:`managed_scope`, :func:`suspended`, :func:`init_optimizer_state`,
:func:`access_paths`, :func:`current` (+ ``ManagedScope.on_bound``).  See docs/scope.md.
"""
from .interception import suspended
from .naming import access_paths
from .optim import init_optimizer_state
from .scope import ManagedScope, Report, current, managed_scope

__all__ = ["ManagedScope", "Report", "access_paths", "current", "init_optimizer_state", "managed_scope", "suspended"]
