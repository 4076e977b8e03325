"""The serving engine's configuration (one dataclass; ``gpu-anchor serve``'s options build it:
``serve/cli.py``), and the fault-injection points the tests name."""
from __future__ import annotations

from dataclasses import dataclass, field

# Fault-injection points (tests): mid_prefill / mid_decode fire halfway through the layers of
# the first step at or after the given one that has prefill work / only decodes.
PHASES = ("between_steps", "mid_prefill", "mid_decode", "before_commit", "after_commit")
# after_launch: the step's forward (and, with async scheduling, the next step's) is enqueued and the
# previous commit handed to the commit thread; the step's tokens are not read yet.  Not drawn by
# the random campaigns of PHASES (their seeded plans stay as they were); tests name it.
ALL_PHASES = PHASES + ("after_launch",)


@dataclass
class EngineConfig:
    model: str                       # model dir (config + safetensors) or, with random_weights, a config path
    random_weights: bool = False
    tokenizer: str | None = None     # directory of tokenizer.json, for structured output (None: the model's)
    seed: int = 0                    # for random weights
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 256
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    max_model_len: int = 2048
    anchor: bool = True
    namespace: str | None = None
    socket: str | None = None        # daemon socket
    fault: tuple[int, str] | None = None   # (step, phase): SIGKILL self there (tests)
    cpu_threads: int | None = None   # torch intra-op threads on the CPU (None: torch's default)
    # decode steps from CUDA graphs; None: on for CUDA.  True on the CPU runs the same padded
    # static-buffer path without capture (tests its bookkeeping)
    cuda_graphs: bool | None = None
    # the first steps of an engine run eagerly: a restarted engine's first tokens are not
    # held up by capturing a graph (each size is captured at its first use after these)
    graph_after_steps: int = 2
    # batch-invariant kernels (batch_invariant.py): a request's tokens do not depend on the
    # batch it runs in, so a recomputed step or prefill gives exactly the fault-free tokens
    deterministic: bool = False
    # asynchronous scheduling (async_step.py): in steady decode the next step is launched
    # before this one's tokens are read (vLLM's --async-scheduling); None: on for CUDA without
    # tensor parallelism (H200, 8B, 64 streams: 6.04 vs 7.30 ms a decode step), off on the CPU
    async_scheduling: bool | None = None
    # the CUDA matmul library (torch.backends.cuda.preferred_blas_library, set process-wide when
    # the engine starts): "cublas", "cublaslt", None to leave it as it is, or "auto": cuBLASLt
    # when no decode step has more than 64 rows (max_num_seqs <= 64), else cuBLAS.  On the
    # H200 (8B shape, bench decode_gemm) a decode step's matmuls took 4.15 / 4.24 / 5.00 ms with
    # cuBLASLt against 4.38 / 4.40 / 4.82 ms with cuBLAS at 32 / 64 / 128 rows
    blas_library: str | None = "auto"
    # tensor parallelism (tp.py): this process is rank ``rank`` of ``tensor_parallel_size``;
    # ``rendezvous``: the path prefix of this incarnation's control socket and store
    # LoRA adapters served beside the base model (lora.py): ((name, adapter directory), ...); a
    # request names one in SamplingParams.lora.  Ranks above max_lora_rank are refused
    lora: tuple = ()
    max_lora_rank: int = 16
    # the adapters' slots on the device (0: as many as ``lora``); with ``runtime_lora``
    # (VLLM_ALLOW_RUNTIME_LORA_UPDATING) adapters are also loaded and unloaded while serving
    # (Engine.load_lora_adapter), every projection having room for one of rank max_lora_rank
    max_loras: int = 0
    runtime_lora: bool = False
    # the adapters whose tensors the host keeps (vLLM's --max-cpu-loras; None: every served one): a
    # parked adapter beyond them is read again from its files when a request needs it
    max_cpu_loras: int | None = None
    # prefix caching (prefix_cache.py, vLLM's --enable-prefix-caching, on by default as there): a
    # request whose first blocks of tokens another request computed shares their KV instead of
    # computing it again
    prefix_caching: bool = True
    tensor_parallel_size: int = 1
    rank: int = 0
    rendezvous: str | None = None
    extra: dict = field(default_factory=dict)
