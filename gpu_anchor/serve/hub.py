"""Where ``gpu-anchor serve MODEL`` finds the model's files: a local directory, or, as vLLM
takes it, a Hugging Face Hub id (``Qwen/Qwen3-8B``), read from the local Hugging Face cache
and downloaded into it when missing (``huggingface_hub.snapshot_download``: ``HF_HOME`` /
``HF_HUB_CACHE``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` apply; ``--revision``,
``--download-dir`` as vLLM's).  Only what serving reads is fetched: the config, the
safetensors weights and the tokenizer's and chat template's files.

Runs in the supervisor before it imports torch: the download's threads are joined before the
supervisor forks anything.  A hub id that cannot be had (not cached while offline, unknown,
gated, no network) is a ``ModelNotFound`` naming the id and the fix.
"""
from __future__ import annotations

import logging
import os
import re

log = logging.getLogger("gpu_anchor.serve")

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
SERVING_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


class ModelNotFound(ValueError):
    """The model named on the command line cannot be found or fetched."""


def is_hub_id(name: str) -> bool:
    return not os.path.exists(name) and HUB_ID.fullmatch(name) is not None


def snapshot(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """The local directory of ``repo_id``'s files that serving reads (fetched if missing)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFound(f"{repo_id}: a Hugging Face Hub id needs huggingface_hub (pip install huggingface_hub); "
                            "or give the model's local directory") from None
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=SERVING_FILES)
    except Exception as e:
        kind = type(e).__name__
        if kind == "LocalEntryNotFoundError":
            why = ("not in the local Hugging Face cache, and the hub could not be asked (HF_HUB_OFFLINE is set, or "
                   f"there is no network): fetch it first (`hf download {repo_id}`) or give a local directory")
        elif kind in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
            why = (f"{kind}: no such repository or revision, or one you may not read (log in with `hf auth login` "
                   "or set HF_TOKEN for a gated model)")
        else:
            why = f"could not be fetched: {kind}: {e}"
        raise ModelNotFound(f"{repo_id}{'@' + revision if revision else ''}: {why}") from None
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ModelNotFound(f"{repo_id}: the repository has no safetensors weights (this server reads only those)")
    log.info("model %s: %s", repo_id, path)
    return path


def resolve(args) -> None:
    """Turn ``args.model`` (and ``args.tokenizer``) from hub ids into local directories; the
    served model name defaults to the id, as in vLLM."""
    if getattr(args, "random_weights", False):
        return
    if is_hub_id(args.model):
        args.served_model_name = args.served_model_name or args.model
        args.model = snapshot(args.model, args.revision, args.download_dir)
    if args.tokenizer and is_hub_id(args.tokenizer):
        args.tokenizer = snapshot(args.tokenizer, None, args.download_dir)
