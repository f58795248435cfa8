#!/usr/bin/env python3
"""lce against PyTorch on the CPU: forward + backward of the mean NLL of a language-model head.

For each shape (H, V, N), float32, best of R repetitions, it times

  torch plain    logits = F.linear(x, w); F.cross_entropy(logits, y).backward()
                 (materialises the [N, V] logits and their gradient)
  torch chunked  F.linear_cross_entropy(x, w, y, options=nn.LinearCrossEntropyOptions())
                 (PyTorch's own chunked path), .backward()
  lce fused      lce_demo --no-reference (forward_backward, one sweep), when --lce-demo
                 points at the built demo (default: build/release/examples/lce_demo)

and the peak extra memory of each, beyond the inputs and the gradients: for torch the
growth of the process peak RSS (VmHWM, reset through /proc/self/clear_refs before each
run) over the RSS before it, less the dX and dW it allocates; for lce the bytes it
allocated (the demo counts operator new), plus the demo's whole-process VmHWM.

  python3 bench/torch_compare.py [--hidden 512,1024] [--vocab 32000,128256]
                                 [--tokens 4096] [--threads 0] [--reps 2]

PyTorch is only a peer to compare against, never a dependency of lce.
"""
import argparse
import os
import re
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def ints(text):
    return [int(v) for v in text.split(",") if v]


def rss_bytes(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_bytes():
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def measure_torch(method, h, v, n, threads, reps):
    """In this (fresh) process: best time and peak RSS growth of one method."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1234)
    x = ((torch.rand(n, h, generator=gen) * 2 - 1) * 3 ** 0.5).requires_grad_(True)
    w = ((torch.rand(v, h, generator=gen) * 2 - 1) * 3 ** 0.5 * 3 / h ** 0.5).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=gen)
    fn = {"plain": plain, "chunked": chunked}[method]
    best, peak = float("inf"), 0
    for _ in range(reps):
        x.grad = None
        w.grad = None
        reset_peak_rss()
        before = rss_bytes("VmRSS")
        t0 = time.perf_counter()
        loss = fn(x, w, y)
        loss.backward()
        best = min(best, time.perf_counter() - t0)
        grads = 4 * (x.numel() + w.numel())
        peak = max(peak, rss_bytes("VmHWM") - before - grads)
        del loss
    print(f"{best} {peak}")


def run_torch(method, h, v, n, threads, reps):
    out = subprocess.run([sys.executable, __file__, "--one", method, str(h), str(v), str(n),
                          "--threads", str(threads), "--reps", str(reps)],
                         check=True, capture_output=True, text=True).stdout.split()
    return float(out[-2]), float(out[-1])


def plain(x, w, y):
    return F.cross_entropy(F.linear(x, w), y)


def chunked(x, w, y):
    return F.linear_cross_entropy(x, w, y, options=torch.nn.LinearCrossEntropyOptions())


def run_lce(demo, h, v, n, threads, reps):
    """Best time, allocated bytes and VmHWM of lce_demo's fused sweep (best of reps in one process)."""
    out = subprocess.run([demo, "--tokens", str(n), "--hidden", str(h), "--vocab", str(v),
                          "--threads", str(threads), "--reps", str(reps), "--no-reference"],
                         check=True, capture_output=True, text=True).stdout
    row = re.search(r"\(a\) lce forward_backward[^|]*\|\s*([\d.]+)\s*\|\s*[\d.]+\s*\|\s*([\d.]+) MiB", out)
    rss = re.search(r"VmHWM[^:]*: \(a\) ([\d.]+) MiB", out)
    return float(row.group(1)), float(row.group(2)), float(rss.group(1))


def torch_blas():
    """torch's BLAS for float32 CPU matmul and the SIMD level its kernels use, in one line."""
    config = torch.__config__.show()
    found = re.search(r"BLAS_INFO=(\w+)", config)
    blas = found.group(1) if found else "unknown"
    mkl = re.search(r"Math Kernel Library Version ([\d.]+)", config)
    if blas == "mkl" and mkl:
        blas = f"MKL {mkl.group(1)}"
    return f"torch BLAS: {blas}, CPU capability {torch.backends.cpu.get_cpu_capability()}"


def lce_blas(demo):
    """The demo's "BLAS: ..." line (lce::blas_info()): library, kernels, and a warning if slow."""
    out = subprocess.run([demo, "--tokens", "8", "--hidden", "8", "--vocab", "16", "--threads", "1",
                          "--no-reference"], capture_output=True, text=True).stdout
    return next((line for line in out.splitlines() if line.startswith("BLAS:")), "BLAS: (not reported)")


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=ints, default=[512, 1024])
    parser.add_argument("--vocab", type=ints, default=[32000, 128256])
    parser.add_argument("--tokens", type=ints, default=[4096])
    parser.add_argument("--threads", type=int, default=0, help="0: all hardware threads")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--lce-demo", default=os.path.join(root, "build/release/examples/lce_demo"))
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # internal: METHOD H V N
    args = parser.parse_args()

    threads = args.threads or os.cpu_count()
    if args.one:
        method, h, v, n = args.one
        return measure_torch(method, int(h), int(v), int(n), threads, args.reps)
    have_lce = os.access(args.lce_demo, os.X_OK)
    if not have_lce:
        print(f"note: {args.lce_demo} not found; build the demo for the lce column", file=sys.stderr)
    mib = 1.0 / (1 << 20)
    print(f"torch {torch.__version__}, {threads} threads, float32, best of {args.reps}; "
          f"time in s, peak extra memory in MiB (torch: VmHWM growth less dX, dW; lce: bytes allocated)")
    print(torch_blas())
    print(f"lce {lce_blas(args.lce_demo)}" if have_lce else "lce BLAS: (no demo)")
    print()
    print("|    H |      V |     N | plain s | plain MiB | chunked s | chunked MiB | lce s | lce MiB "
          "| lce VmHWM MiB | plain/lce s | chunked/lce s |")
    print("|-----:|-------:|------:|--------:|----------:|----------:|------------:|------:|--------:"
          "|--------------:|------------:|--------------:|")
    for h in args.hidden:
        for v in args.vocab:
            for n in args.tokens:
                # plain holds the logits, their gradient and a softmax: ~3 [N, V] fp32 tensors
                tp = mp = float("nan")
                if 3 * 4 * n * v < 0.8 * available_bytes():
                    tp, mp = run_torch("plain", h, v, n, threads, args.reps)
                tc, mc = run_torch("chunked", h, v, n, threads, args.reps)
                tl = ml = hl = float("nan")
                if have_lce:
                    tl, ml, hl = run_lce(args.lce_demo, h, v, n, threads, args.reps)
                print(f"| {h:4d} | {v:6d} | {n:5d} | {tp:7.2f} | {mp * mib:9.0f} | {tc:9.2f} "
                      f"| {mc * mib:11.0f} | {tl:5.2f} | {ml:7.0f} | {hl:13.0f} | {tp / tl:11.2f} "
                      f"| {tc / tl:13.2f} |", flush=True)


if __name__ == "__main__":
    main()
