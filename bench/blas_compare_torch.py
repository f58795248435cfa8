#!/usr/bin/env python3
"""torch.mm GFLOP/s at lce's three GEMM layouts (the PyTorch rows of bench/blas_compare.sh)."""
import sys, time, torch
C, H, V = 1024, 1024, 32000
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
g = torch.Generator().manual_seed(1)
x = torch.rand(C, H, generator=g) - 0.5
w = torch.rand(V, H, generator=g) - 0.5
z = torch.rand(C, V, generator=g) - 0.5
def best(f):
    """GFLOP/s of wall time and GFLOP per second of process CPU time, best of reps each."""
    f()
    b = c = 1e300
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        f()
        c = min(c, time.process_time() - c0)
        b = min(b, time.perf_counter() - t0)
    flops = 2.0 * C * V * H
    return flops / b * 1e-9, flops / c * 1e-9
cap = torch.backends.cpu.get_cpu_capability()
for t in (1, 2):
    torch.set_num_threads(t)
    nt = best(lambda: torch.mm(x, w.t()))
    nn = best(lambda: torch.mm(z, w))
    tn = best(lambda: torch.mm(z.t(), x))
    print(f"{'torch ' + torch.__version__:<28} | {cap:<12} | {t} | {nt[0]:6.1f} | {nn[0]:6.1f} | {tn[0]:6.1f}"
          f" | {nt[1]:6.1f} | {nn[1]:6.1f} | {tn[1]:6.1f}", flush=True)
