"""The layering, read from the source (module-level and lazy imports alike; docs/runtime.md
"Layering" draws it):

    daemon ─ client ─ scope ─ train ─┐
                          └─ serve ──┼─ launch (supervisor: run, torchrun, serve)
    runtime (process runtime) ──────┘   checkpoint (a library launch uses)

Shared modules (protocol, paths, errors, dtypes, journal_keys, cuda_driver, fdwait) sit below all of
them.  Each rule names what a package must not import; an allowed exception is a named,
documented interface: ``python -m gpu_anchor.serve`` starts the supervisor (serving is given
the checkpoint library's migration by whoever starts the engine:
``gpu_anchor.serve.migration.provide``, imported nowhere under serve/).
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "gpu_anchor"
PRODUCT = ("daemon", "client", "scope", "train", "serve", "checkpoint", "launch", "runtime")

# package -> prefixes it must not import
FORBIDDEN = {
    "daemon": ("torch", "gpu_anchor.client", "gpu_anchor.scope", "gpu_anchor.train", "gpu_anchor.serve",
               "gpu_anchor.checkpoint", "gpu_anchor.launch", "gpu_anchor.runtime"),
    "client": ("gpu_anchor.scope", "gpu_anchor.train", "gpu_anchor.serve", "gpu_anchor.checkpoint",
               "gpu_anchor.launch"),
    "scope": ("gpu_anchor.train", "gpu_anchor.launch", "gpu_anchor.serve", "gpu_anchor.checkpoint"),
    "train": ("gpu_anchor.launch", "gpu_anchor.checkpoint", "gpu_anchor.serve"),
    "checkpoint": ("gpu_anchor.launch", "gpu_anchor.serve", "gpu_anchor.train"),
    "serve": ("gpu_anchor.checkpoint", "gpu_anchor.train", "gpu_anchor.launch"),
    "runtime": ("gpu_anchor.client", "gpu_anchor.scope", "gpu_anchor.train", "gpu_anchor.serve",
                "gpu_anchor.checkpoint", "gpu_anchor.launch", "gpu_anchor.daemon"),
}
# (importing file, imported module): the named interfaces
ALLOWED = {
    ("serve/__main__.py", "gpu_anchor.launch.serve"),          # the entry point starts the supervisor
}


def imports(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """``(line, absolute module, at module level)`` for every import in ``path``."""
    rel = path.relative_to(ROOT.parent).with_suffix("").parts
    package = list(rel[:-1])      # what `from .` means here (a package's __init__ included)
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for n in tree.body:      # `if TYPE_CHECKING:`-free code: imports in top-level try/if count as top
        if isinstance(n, (ast.If, ast.Try)):
            top |= {id(m) for m in ast.walk(n)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name, id(n) in top) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = package[: len(package) - n.level + 1]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            # `from gpu_anchor.checkpoint import format` imports gpu_anchor.checkpoint.format
            out += [(n.lineno, f"{mod}.{a.name}" if n.module is None or _is_package(mod) else mod, id(n) in top)
                    for a in n.names]
    return out


def _is_package(mod: str) -> bool:
    return mod.startswith("gpu_anchor") and (ROOT.parent / mod.replace(".", "/")).is_dir()


def _violations() -> list[str]:
    bad = []
    for pkg in PRODUCT:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            for line, mod, _ in imports(f):
                if (rel, mod) in ALLOWED or any(mod == a or mod.startswith(a + ".") for r, a in ALLOWED if r == rel):
                    continue
                for forb in FORBIDDEN.get(pkg, ()) + ("gpu_anchor.testing",):
                    if mod == forb or mod.startswith(forb + "."):
                        bad.append(f"{rel}:{line} imports {mod} ({pkg}/ must not import {forb})")
    for f in sorted(ROOT.glob("*.py")):           # shared modules and the CLI: nothing of testing
        for line, mod, _ in imports(f):
            if mod.startswith("gpu_anchor.testing"):
                bad.append(f"{f.name}:{line} imports {mod} (the product does not import gpu_anchor.testing)")
    return bad


def test_layers_import_downward_only():
    assert _violations() == []


def test_runtime_and_shared_modules_import_no_torch_at_load():
    """The process runtime and the shared modules load without torch (the supervisor of a
    non-torch job, the daemon and the fork server's parent never pay for it)."""
    files = list((ROOT / "runtime").rglob("*.py")) + [ROOT / n for n in ("journal_keys.py", "paths.py",
                                                                         "protocol.py", "errors.py", "fdwait.py")]
    files += [ROOT / "checkpoint" / "format.py", ROOT / "checkpoint" / "settings.py", ROOT / "train" / "step_hooks.py"]
    bad = [f"{f.relative_to(ROOT)}:{line}" for f in files for line, mod, top in imports(f)
           if top and (mod == "torch" or mod.startswith("torch."))]
    assert bad == []


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """A rule that cannot fail checks nothing: a train module importing the supervisor is caught,
    lazily inside a function too."""
    fake = tmp_path / "gpu_anchor"
    (fake / "train").mkdir(parents=True)
    (fake / "train" / "bad.py").write_text("def f():\n    from gpu_anchor.launch import step_boundary\n")
    (fake / "train" / "worse.py").write_text("from ..checkpoint import snapshot\n")
    monkeypatch.setitem(globals(), "ROOT", fake)
    got = _violations()
    assert any("train/bad.py:2 imports gpu_anchor.launch" in v for v in got), got
    assert any("train/worse.py:1 imports gpu_anchor.checkpoint" in v for v in got), got  # relative, too
