"""Serve a tiny random-weight Qwen3 on the CPU, stream from it with the stock openai client,
SIGKILL the engine mid-stream, and watch the stream continue.

    .venv/bin/python examples/serve_tiny.py
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

from gpu_anchor.testing.tiny import make_tiny_model


def main() -> None:
    d = tempfile.mkdtemp()
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = os.path.join(d, "sock")
    model = make_tiny_model(os.path.join(d, "tiny-qwen3"), "qwen3")
    port_file = os.path.join(d, "port")
    server = subprocess.Popen([sys.executable, "-m", "gpu_anchor.serve", model, "--device", "cpu",
                               "--port", "0", "--port-file", port_file])
    try:
        while not os.path.exists(port_file):
            time.sleep(0.1)
        base = f"http://127.0.0.1:{open(port_file).read()}"
        health = lambda: json.load(urllib.request.urlopen(base + "/health"))  # noqa: E731
        while True:
            try:
                pid = health()["engine_pid"]
                break
            except Exception:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        stream = client.completions.create(model="tiny-qwen3", prompt="The quick brown fox", max_tokens=60,
                                           temperature=0, stream=True)
        for i, chunk in enumerate(stream):
            print(repr(chunk.choices[0].text), end=" ", flush=True)
            if i == 10:
                os.kill(pid, signal.SIGKILL)
                print("\n[engine SIGKILLed; the stream continues]\n", flush=True)
        print("\nrecovery breakdown:", health()["last_recovery"])
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait()
        from gpu_anchor.client import control
        control.stop("cpu")


if __name__ == "__main__":
    main()
