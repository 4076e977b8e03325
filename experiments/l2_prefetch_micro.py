"""Scratch (experiment commit only): does an L2 prefetch of o_proj's weight beside a 42 MB read speed the GEMM up?  Run with PYTHONPATH=. on a GPU; writes /tmp/c1/prefetch_micro.json."""
import json, os, sys, torch
os.makedirs("/tmp/c1", exist_ok=True)
from gpu_anchor.serve import prefetch
dev = torch.device("cuda:0")
L = 36
W = [torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) for _ in range(L)]
KV = [torch.randn(21 << 20, device=dev, dtype=torch.bfloat16) for _ in range(L)]   # 42 MB a layer
res = {}
for rows in (32, 64, 128):
    x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
    pf = prefetch.WeightPrefetch(dev); pf.evict_last, pf.wait = True, True
    pfn = prefetch.WeightPrefetch(dev); pfn.evict_last, pfn.wait = False, True
    pfl = prefetch.WeightPrefetch(dev); pfl.evict_last, pfl.wait = True, False
    outs = {}
    def variant(name, fn):
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(); fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for _ in range(3): g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(7):
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record(); [g.replay() for _ in range(5)]; b.record(); torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 5 / L * 1e3)
        ts.sort()
        res[f"{rows}/{name}"] = {"us_per_layer_min": ts[0], "us_per_layer_median": ts[3]}
        print(rows, name, "min %.2f median %.2f us/layer" % (ts[0], ts[3]), flush=True)
    y = torch.empty(rows, 4096, device=dev, dtype=torch.bfloat16)
    sums = torch.empty(L, device=dev, dtype=torch.float32)
    def gemm():
        for i in range(L): torch.mm(x, W[i].t(), out=y)
    def read():
        for i in range(L): torch.sum(KV[i], 0, dtype=torch.float32, out=sums[i])
    def read_gemm():
        for i in range(L):
            torch.sum(KV[i], 0, dtype=torch.float32, out=sums[i]); torch.mm(x, W[i].t(), out=y)
    def read_pf_gemm():
        for i in range(L):
            pf.start(W[i]); torch.sum(KV[i], 0, dtype=torch.float32, out=sums[i]); pf.join(); torch.mm(x, W[i].t(), out=y)
    def read_pfn_gemm():
        for i in range(L):
            pfn.start(W[i]); torch.sum(KV[i], 0, dtype=torch.float32, out=sums[i]); pfn.join(); torch.mm(x, W[i].t(), out=y)
    def read_pfl_gemm():
        for i in range(L):
            pfl.start(W[i]); torch.sum(KV[i], 0, dtype=torch.float32, out=sums[i]); pfl.join(); torch.mm(x, W[i].t(), out=y)
        pfl.join(final=True)
    def pf_then_gemm():
        for i in range(L):
            pf.start(W[i]); pf.join(); torch.mm(x, W[i].t(), out=y)
    def pf_only():
        for i in range(L):
            pf.start(W[i]); pf.join()
    ref = None
    for name, fn in (("gemm", gemm), ("read", read), ("read+gemm", read_gemm), ("read||prefetch+gemm", read_pf_gemm),
                     ("read||prefetch(normal)+gemm", read_pfn_gemm), ("read||prefetch(no join) gemm", read_pfl_gemm),
                     ("prefetch;gemm", pf_then_gemm), ("prefetch", pf_only)):
        variant(name, fn)
        if "gemm" in name:
            torch.cuda.synchronize()
            if ref is None: ref = y.clone()
            # the last layer's output: same bits with or without a prefetch
            res[f"{rows}/{name}/equal"] = bool(torch.equal(y, ref))
json.dump(res, open("/tmp/c1/prefetch_micro.json", "w"), indent=1)
