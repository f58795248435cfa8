#!/usr/bin/env python3
"""The bf16 GEMMs inside PyTorch's libtorch_cpu at the three layouts of one LM-head step,
hidden x[N, H], weight w[V, H], logit gradient dz[N, V]:

  logits  z  = x w^T    [N, V]   (NT)
  dX      dx = dz w     [N, H]   (NN)
  dW      dw = dz^T x   [V, H]   (TN)

  torch.mm   PyTorch's own bf16 matmul (oneDNN's AMX / AVX512-BF16 kernels inside
             libtorch_cpu), bf16 out: what the plain F.linear + F.cross_entropy path runs
  MKL        cblas_gemm_bf16bf16f32 from the same libtorch_cpu (fp32 out), what
             lce_torch's GEMM provider calls, here as one call with MKL's own threads

  --lce-torch-calls  also torch.mm on lce_torch's own calls (traced at N = 512, H = 1,024,
             V = 32,000): per vocabulary tile of 1,024 rows, each GEMM in two halves of 512,
             logits [N, 512] of the tile's rows, dX [N, 512] of H's columns over the tile's
             1,024 rows of dz (kept over the first half of each fp32 logit row: rows 4 KiB
             apart), dW [512, H] of the tile's rows into the bf16 weight gradient; bf16 out
             each (lce's kernel writes fp32 logits and adds dX in fp32). The row
             "torch.mm calls"; lce_bf16_gemm's "lce amx calls" runs lce's kernel on them.

GFLOP/s of wall time, best of --reps, for each thread count; both read the same bf16
inputs. The question it answers: how much of lce_torch's bf16 time against the plain
path is the GEMM library's (lce needs the fp32 output that libtorch_cpu's oneDNN does
not export on the CPU: aten::mm.dtype has no CPU kernel).

  python bench/bf16_gemm_torch.py [--tokens 512,1024] [--vocab 32000] [--hidden 1024]
                                  [--threads 2,1] [--reps 5] [--lce-torch-calls]
"""
import argparse
import ctypes
import os
import time

import torch

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def mkl_bf16_gemm():
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    try:
        fn = lib.cblas_gemm_bf16bf16f32
    except AttributeError:
        return None
    fn.restype = None
    fn.argtypes = ([ctypes.c_int] * 3 + [ctypes.c_int64] * 3 +
                   [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                    ctypes.c_float, ctypes.c_void_p, ctypes.c_int64])
    return fn


def best(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def lce_torch_calls(x, w, dz, dw16, tile=1024, half=512):
    """The three GEMMs of a step as lce_torch calls them (see --lce-torch-calls), one
    function each, torch.mm writing bf16."""
    n, h = x.shape
    v = w.shape[0]
    kept = torch.empty(n, tile, dtype=torch.float32).view(torch.bfloat16)[:, :tile]  # rows 4 KiB apart
    kept.copy_(dz[:, :tile])
    z16, dx16 = torch.empty(n, half, dtype=torch.bfloat16), torch.empty(n, h // 2, dtype=torch.bfloat16)
    tiles = [(v0, min(tile, v - v0)) for v0 in range(0, v, tile)]

    def logits():
        for v0, rows in tiles:
            for first in range(0, rows, half):
                m = min(half, rows - first)
                torch.mm(x, w[v0 + first:v0 + first + m].t(), out=z16[:, :m])

    def grad_hidden():
        for v0, rows in tiles:
            for c0 in (0, h // 2):
                torch.mm(kept[:, :rows], w[v0:v0 + rows, c0:c0 + h // 2], out=dx16)

    def grad_weight():
        for v0, rows in tiles:
            for first in range(0, rows, half):
                m = min(half, rows - first)
                torch.mm(kept[:, first:first + m].t(), x, out=dw16[v0 + first:v0 + first + m])

    return [logits, grad_hidden, grad_weight]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,1024")
    p.add_argument("--vocab", default="32000")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--threads", default="2,1")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--lce-torch-calls", action="store_true")
    args = p.parse_args()
    gemm = mkl_bf16_gemm()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          f"MKL cblas_gemm_bf16bf16f32: {'found' if gemm else 'not in this libtorch_cpu'}")
    print("| N | V | threads | library | logits (NT) | dX (NN) | dW (TN) | three GEMMs, ms |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|")
    h = args.hidden
    for v in [int(s) for s in args.vocab.split(",")]:
        for n in [int(s) for s in args.tokens.split(",")]:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(n, h, generator=g).bfloat16()
            w = (torch.randn(v, h, generator=g) * h**-0.5).bfloat16()
            dz = (torch.randn(n, v, generator=g) * 1e-3).bfloat16()
            z, dx, dw = torch.empty(n, v), torch.empty(n, h), torch.empty(v, h)
            # Outputs written in place by both libraries, so neither pays for mapping fresh pages.
            z16, dx16, dw16 = z.bfloat16(), dx.bfloat16(), dw.bfloat16()
            flops = 2.0 * n * h * v
            rows = {"torch.mm": [lambda: torch.mm(x, w.t(), out=z16), lambda: torch.mm(dz, w, out=dx16),
                                 lambda: torch.mm(dz.t(), x, out=dw16)]}
            if gemm:
                rows["MKL"] = [
                    lambda: gemm(ROW_MAJOR, NO_TRANS, TRANS, n, v, h, 1.0, x.data_ptr(), h, w.data_ptr(), h,
                                 0.0, z.data_ptr(), v),
                    lambda: gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, n, h, v, 1.0, dz.data_ptr(), v, w.data_ptr(), h,
                                 0.0, dx.data_ptr(), h),
                    lambda: gemm(ROW_MAJOR, TRANS, NO_TRANS, v, h, n, 1.0, dz.data_ptr(), v, x.data_ptr(), h,
                                 0.0, dw.data_ptr(), h),
                ]
            if args.lce_torch_calls:
                rows["torch.mm calls"] = lce_torch_calls(x, w, dz, dw16)
            for threads in [int(s) for s in args.threads.split(",")]:
                torch.set_num_threads(threads)
                for name, fns in rows.items():
                    secs = [best(f, args.reps) for f in fns]
                    cells = " | ".join(f"{flops / s * 1e-9:.0f}" for s in secs)
                    print(f"| {n:,} | {v:,} | {threads} | {name} | {cells} | {sum(secs) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
