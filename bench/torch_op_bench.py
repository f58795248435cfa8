#!/usr/bin/env python3
"""lce's torch op against PyTorch, side by side in one process: forward + backward of the
mean cross-entropy of an LM head, hidden [N, H] -> logits [N, V] -> loss.

  plain         F.cross_entropy(F.linear(x, w), y)           (materialises the logits and their gradient)
  torch_chunked F.linear_cross_entropy(x, w, y, options=torch.nn.LinearCrossEntropyOptions())
                (PyTorch's own chunked path; loss only)
  lce           lce_torch.linear_cross_entropy(x, w, y)       (one sweep: forward_backward, 3 GEMMs/chunk)
  lce_2sweep    lce_torch.linear_cross_entropy(x, w, y, fused=False)
                (forward, then the backward op: 4 GEMMs/chunk, as for log-probs with any loss)
  lce_<M>mib    lce with workspace_limit_bytes = M MiB (e.g. lce_32mib), and
  lce_chunk<R>  lce with chunks of R tokens,
  lce_share<P>  lce with max_logits_share = P / 100 (e.g. lce_share35: up to 35% of the fp32
                logits' memory to compute each logit once): run only when named in --variants
  lce_amx, lce_avx512bf16, lce_mkl, lce_widen
                lce with that bf16 GEMM (lce_torch.set_bf16_gemm; "lce" and the others run the
                default): run only when named in --variants

For each dtype (float32, bfloat16), vocabulary V and thread count (torch.set_num_threads,
which lce's op follows too), the time of forward + backward (best of --reps after a
warm-up, the paths interleaved rep by rep; wall (min and median) and process CPU time)
and the peak extra memory: the growth of the peak RSS
(VmHWM, reset through /proc/self/clear_refs) over the RSS before the call, less the
gradients dX and dW every path returns.

--allocator says what a path's large buffers cost it (glibc's malloc, set through the
environment by re-executing):
  fresh  (the default) every buffer over 64 KiB is mapped afresh and given back when freed
         (MALLOC_MMAP_THRESHOLD_=65536): each call takes its page faults, as a default
         glibc process does for buffers over 32 MiB (bf16 logits from N x V = 16M up,
         float32 from 8M), and the peak extra memory is measured.
  warm   freed memory stays in the heap and is reused (MALLOC_MMAP_MAX_=0, no trimming), and
         lce keeps its workspace between calls (lce_torch.set_keep_workspace): no path takes
         page faults for its scratch, as with a caching allocator (PyTorch's on a GPU,
         jemalloc or tcmalloc preloaded) or buffers under 32 MiB in a default process. Two
         untimed full-size rounds of every path grow the heap first. This is the arithmetic
         alone (the page-fault column should read about 0); the RSS keeps the heap's
         high-water mark, so the peak extra memory is not measured (None in --json, "-").
  default glibc as it comes, lce as it comes (its workspace given back after each call):
         what a default process sees in a training loop. Buffers under glibc's dynamic
         mmap threshold (at most 32 MiB) are reused from the heap, larger ones mapped
         afresh. The same untimed full-size rounds first; memory not measured.
Each row also gives the minor page faults of its fastest call.

--device cuda runs the same on the GPU (lce_torch built with CUDA): the time is the
wall time with the stream synchronised, and the peak extra memory is
torch.cuda.max_memory_allocated over the allocation before the call (lce's scratch
comes from the same caching allocator, so it is counted), less the gradients;
--threads does not apply.

  python bench/torch_op_bench.py [--hidden 1024] [--vocab 32000,128256] [--tokens 1024,8192]
                                 [--threads 1,2] [--dtypes float32,bfloat16] [--reps 1] [--json out.json]
                                 [--device cpu|cuda] [--allocator fresh|warm|default]
"""
import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

_here = os.path.dirname(os.path.abspath(__file__))
ALLOCATOR_ENV = {
    "fresh": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "warm": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 50), "MALLOC_TOP_PAD_": "0"},
    "default": {},
}
if not os.environ.get("LCE_BENCH_CHILD"):
    allocator = "fresh"
    for i, arg in enumerate(sys.argv):
        if arg == "--allocator" and i + 1 < len(sys.argv):
            allocator = sys.argv[i + 1]
        elif arg.startswith("--allocator="):
            allocator = arg.split("=", 1)[1]
    if allocator not in ALLOCATOR_ENV:
        raise SystemExit(f"--allocator {allocator!r}: fresh, warm or default")
    env = dict(os.environ, LCE_BENCH_CHILD="1", **ALLOCATOR_ENV[allocator])
    if "OPENBLAS_CORETYPE" not in env:
        script = os.path.join(_here, "..", "scripts", "blas-coretype.sh")
        try:
            core = subprocess.run([script], capture_output=True, text=True, check=True).stdout.strip()
            if core:
                env["OPENBLAS_CORETYPE"] = core
        except (OSError, subprocess.CalledProcessError):
            pass
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lce_torch  # noqa: E402


def rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


VARIANTS = {
    "plain": lambda x, w, y: F.cross_entropy(F.linear(x, w), y),
    "torch_chunked": lambda x, w, y: F.linear_cross_entropy(x, w, y, options=torch.nn.LinearCrossEntropyOptions()),
    "lce": lambda x, w, y: lce_torch.linear_cross_entropy(x, w, y),
    "lce_2sweep": lambda x, w, y: lce_torch.linear_cross_entropy(x, w, y, fused=False),
}
DEFAULT_VARIANTS = ",".join(VARIANTS)


BF16_GEMM_VARIANTS = ("lce_amx", "lce_avx512bf16", "lce_mkl", "lce_widen")  # lce on that bf16 GEMM (set_bf16_gemm)


def lce_path(name):
    """lce's variants: a name of VARIANTS, lce_chunk<R>, lce_share<P>, lce_<M>mib or lce_<bf16 GEMM>."""
    if name in VARIANTS:
        return VARIANTS[name]
    if name.startswith("lce_chunk") and name[len("lce_chunk"):].isdigit():
        rows = int(name[len("lce_chunk"):])
        return lambda x, w, y: lce_torch.linear_cross_entropy(x, w, y, chunk_tokens=rows)
    if name.startswith("lce_share") and name[len("lce_share"):].isdigit():
        share = int(name[len("lce_share"):]) / 100
        return lambda x, w, y: lce_torch.linear_cross_entropy(x, w, y, max_logits_share=share)
    if name.startswith("lce_") and name.endswith("mib") and name[4:-3].isdigit():
        limit = int(name[4:-3]) << 20
        return lambda x, w, y: lce_torch.linear_cross_entropy(x, w, y, workspace_limit_bytes=limit)
    if name in BF16_GEMM_VARIANTS:
        return VARIANTS["lce"]
    raise SystemExit(f"unknown variant {name!r}: any of {','.join(VARIANTS)}, lce_chunk<R>, lce_share<P>, lce_<M>mib, "
                     f"{', '.join(BF16_GEMM_VARIANTS)}")


def variant(name):
    """A named path; lce's set their bf16 GEMM first (the backward of a call runs before the
    next path's forward), the default unless the name asks for one."""
    fn = lce_path(name)
    if not name.startswith("lce"):
        return fn
    kernel = name[len("lce_"):] if name in BF16_GEMM_VARIANTS else "auto"

    def run(x, w, y):
        got = lce_torch.set_bf16_gemm(kernel)
        if kernel != "auto" and got != kernel:
            raise SystemExit(f"{name}: this machine runs no {kernel} bf16 GEMM (lce_torch runs {got})")
        return fn(x, w, y)
    return run


def run_once(fn, x, w, y, measure_memory=True):
    x.grad = w.grad = None
    gc.collect()
    cuda = x.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        reset_peak()
        before = rss_kb("VmRSS") * 1024
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = fn(x, w, y)
        loss.backward()
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    peak = (torch.cuda.max_memory_allocated() if cuda else rss_kb("VmHWM") * 1024) - before
    grads = x.grad.numel() * x.grad.element_size() + w.grad.numel() * w.grad.element_size()
    notes = sorted({str(c.message).split("\n")[0][:120] for c in caught})
    return float(loss.detach()), wall, cpu, (peak - grads) if measure_memory else None, faults, notes


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", default="32000,128256")
    p.add_argument("--tokens", default="2048", help="token counts N, comma-separated")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"any of {','.join(VARIANTS)}, lce_chunk<R> (R-token chunks), lce_share<P> "
                        "(max_logits_share P / 100), lce_<M>mib (M MiB workspace)")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--json", default="")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--allocator", default="fresh", choices=list(ALLOCATOR_ENV),
                   help="fresh: every large buffer mapped afresh (page faults; memory measured); "
                        "warm: buffers reused, lce keeps its workspace (no page faults; memory not measured); "
                        "default: glibc and lce as they come (memory not measured)")
    args = p.parse_args()
    cpu = args.device == "cpu"
    lce_torch.set_keep_workspace(cpu and args.allocator == "warm")
    steady = cpu and args.allocator in ("warm", "default")  # full-size warm-up rounds before timing
    measure_memory = not cpu or args.allocator == "fresh"
    if args.device == "cuda":
        if not (torch.cuda.is_available() and lce_torch.built_with_cuda()):
            raise SystemExit("--device cuda: needs a CUDA device and lce_torch built with CUDA "
                             f"(cuda available: {torch.cuda.is_available()}, built: {lce_torch.built_with_cuda()})")
        args.threads = "1"

    info = {
        "torch": torch.__version__,
        "blas": lce_torch.blas_info(),
        "torch_config": [l.strip() for l in torch.__config__.show().splitlines() if "CPU capability" in l
                         or "BLAS_INFO" in l or "MKL" in l[:40]],
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "tokens": [int(n) for n in args.tokens.split(",")],
        "hidden": args.hidden,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "allocator": args.allocator if args.device == "cpu" else "cuda caching allocator",
    }
    print(f"torch {info['torch']}; {info['blas']}; device {info['device']}")
    print(f"N = {args.tokens} tokens, H = {args.hidden}; best of {args.reps} interleaved after a warm-up; "
          f"load average at start {info['load_average'][0]:.1f}; allocator {info['allocator']}")
    results = []
    header = ("| dtype | V | N | threads | path | fwd+bwd wall s (min) | median | CPU s | peak extra MiB | "
              "page faults | loss |")
    print(header)
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for v, tokens in [(int(v), int(n)) for v in args.vocab.split(",") for n in args.tokens.split(",")]:
            g = torch.Generator().manual_seed(0)
            x = (torch.randn(tokens, args.hidden, generator=g)).to(args.device, dtype).requires_grad_(True)
            w = (torch.randn(v, args.hidden, generator=g) * args.hidden**-0.5).to(args.device, dtype)
            w.requires_grad_(True)
            y = torch.randint(0, v, (tokens,), generator=g).to(args.device)
            small = (x[:256].detach().clone().requires_grad_(True), w, y[:256])
            for threads in [int(s) for s in args.threads.split(",")]:
                torch.set_num_threads(threads)
                paths = {name: variant(name) for name in args.variants.split(",")}
                names = list(paths)
                for name in names:
                    run_once(paths[name], *small)  # warm-up: lazy initialisation, thread pools
                if steady:
                    # The heap grows to hold every path's reused buffers (and lce keeps its
                    # workspace when warm) before anything is timed: two rounds, as freed blocks settle.
                    for _ in range(2):
                        for name in names:
                            run_once(paths[name], x, w, y, measure_memory=False)
                # Interleaved (plain, ..., lce, plain, ...): a slow spell of a shared machine
                # lands on every path, not on one path's block of repetitions.
                runs = {name: [] for name in names}
                for _ in range(args.reps):
                    for name in names:
                        runs[name].append(run_once(paths[name], x, w, y, measure_memory=measure_memory))
                for name in names:
                    loss, wall, cpu, extra, faults, notes = min(runs[name], key=lambda r: r[1])
                    median = statistics.median(r[1] for r in runs[name])
                    row = dict(dtype=dtype_name, vocab=v, hidden=args.hidden, tokens=tokens, threads=threads,
                               path=name, wall_s=wall, median_wall_s=median, cpu_s=cpu, peak_extra_bytes=extra,
                               minor_page_faults=faults,
                               loss=loss, notes=notes)
                    results.append(row)
                    note = f" ({'; '.join(notes)})" if notes else ""
                    memory = "-" if extra is None else f"{extra / 2**20:.0f}"
                    print(f"| {dtype_name} | {v} | {tokens} | {threads} | {name} | {wall:.3f} | {median:.3f} | {cpu:.3f} | "
                          f"{memory} | {faults} | {loss:.4f} |{note}", flush=True)
            del x, w, y, small
            gc.collect()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
