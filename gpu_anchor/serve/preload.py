"""Imports an engine process needs, done once in a zygote before forking engines.

Importing runs no torch op, so no thread pool exists yet and forking stays safe (GNU
OpenMP hangs in a child forked after the parent ran a parallel region).  Used by
``multiprocessing``'s forkserver (``set_forkserver_preload(["gpu_anchor.serve.preload"])``)
and by the ``serve`` supervisor.
"""
import torch  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.mistral.modeling_mistral  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
import transformers.models.qwen3.modeling_qwen3  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

from gpu_anchor.serve import engine, worker  # noqa: F401
