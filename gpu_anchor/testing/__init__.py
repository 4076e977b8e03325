"""Test and benchmark drivers: kill campaigns, workloads and tiny models (not the product).

The tests, the benchmarks and the examples import this package; nothing else under
``gpu_anchor`` does (tests/test_layering.py checks it).

- ``campaign`` — SIGKILL campaigns against the step protocol on a tiny CPU model
- ``ddp_campaign`` / ``ddp_gpu`` / ``fsdp_llama`` — the same for DDP and FSDP2 groups
- ``gpu_campaign`` — a 1B-shaped single-GPU kill campaign
- ``workload`` — a small training job for the checkpoint tests
- ``tiny`` — tiny random-weight Llama/Qwen models and a local tokenizer
"""
