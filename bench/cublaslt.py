"""A minimal ctypes binding of cuBLASLt, for ``decode_gemm --cublaslt-algos``: the algorithms
cuBLASLt's heuristic offers for ``y = x @ w.T`` (bf16 in and out, fp32 accumulation — the call
torch's ``F.linear`` makes), and a matmul with a chosen one.

The library is the one torch has loaded (found in ``/proc/self/maps`` after a first bf16
matmul), so the kernels and the version are torch's own.  Linux and CUDA only.
Enum values are cuBLASLt's (``cublasLt.h``); the heuristic result is its C struct.
"""
from __future__ import annotations

import ctypes

COMPUTE_32F, R_32F, R_16BF = 68, 0, 14          # cublasComputeType_t, cudaDataType_t
DESC_TRANSA, DESC_TRANSB = 3, 4                  # cublasLtMatmulDescAttributes_t
PREF_MAX_WORKSPACE_BYTES = 1                     # cublasLtMatmulPreferenceAttributes_t
# cublasLtMatmulAlgoConfigAttributes_t: name -> (value, C size)
CONFIG = {"algo_id": (0, 4), "tile": (1, 4), "split_k": (2, 4), "reduction": (3, 4), "swizzle": (4, 4),
          "stages": (6, 4), "cluster": (8, 2)}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed (status {status})")


def load():
    """torch's libcublasLt (CUDA): ``(library, handle)``."""
    import torch
    import torch.nn.functional as F
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    F.linear(a, a)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcublasLt" in line:
                lib = ctypes.CDLL(line.split()[-1])
                handle = ctypes.c_void_p()
                _check(lib.cublasLtCreate(ctypes.byref(handle)), "create")
                return lib, handle
    raise RuntimeError("libcublasLt is not loaded in this process (is torch's CUDA build cuBLAS-backed?)")


def unload(lib, handle) -> None:
    """Destroys the handle ``load`` created."""
    _check(lib.cublasLtDestroy(handle), "destroy")


class Linear:
    """``y[M, N] = x[M, K] @ w[N, K].T`` by cuBLASLt, laid out as torch lays out ``F.linear``
    (column-major ``D[N, M] = op_T(w: K × N, ld K) · x (K × M, ld K)``)."""

    def __init__(self, lib, handle, m: int, k: int, n: int, workspace_bytes: int) -> None:
        self.lib, self.handle, self.workspace_bytes = lib, handle, workspace_bytes
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "descriptor")
        for attr, op in ((DESC_TRANSA, 1), (DESC_TRANSB, 0)):
            v = ctypes.c_int(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "transpose")
        self.a, self.b, self.c = (ctypes.c_void_p() for _ in range(3))
        for lay, rows, cols in ((self.a, k, n), (self.b, k, m), (self.c, n, m)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), R_16BF, ctypes.c_uint64(rows),
                                                  ctypes.c_uint64(cols), ctypes.c_int64(rows)), "layout")
        self.pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference")
        ws = ctypes.c_uint64(workspace_bytes)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "workspace preference")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def close(self) -> None:
        """Destroys the descriptor, the three layouts and the preference (once)."""
        if self.desc is None:
            return
        _check(self.lib.cublasLtMatmulPreferenceDestroy(self.pref), "preference destroy")
        for lay in (self.a, self.b, self.c):
            _check(self.lib.cublasLtMatrixLayoutDestroy(lay), "layout destroy")
        _check(self.lib.cublasLtMatmulDescDestroy(self.desc), "descriptor destroy")
        self.desc = None

    def candidates(self, count: int) -> list[HeuristicResult]:
        """The heuristic's answers, best first (at most ``count``), those it says can run."""
        res = (HeuristicResult * count)()
        got = ctypes.c_int()
        _check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.c, self.c,
                                                       self.pref, count, res, ctypes.byref(got)), "heuristic")
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def config(self, cand: HeuristicResult) -> dict:
        out = {}
        for name, (attr, size) in CONFIG.items():
            v = ctypes.c_uint32(0) if size == 4 else ctypes.c_uint16(0)
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(cand.algo), attr, ctypes.byref(v), size,
                                                             ctypes.byref(ctypes.c_size_t())) == 0:
                out[name] = v.value
        return out

    def __call__(self, x, w, y, cand: HeuristicResult, workspace) -> None:
        """``y = x @ w.T`` with ``cand``'s algorithm on torch's current stream (capturable)."""
        import torch
        _check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()), self.c,
            ctypes.c_void_p(y.data_ptr()), self.c, ctypes.byref(cand.algo), ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_size_t(self.workspace_bytes), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "matmul")
