#!/usr/bin/env python3
"""A small GPT trained on the CPU twice: once with the materialised loss
F.cross_entropy(F.linear(h, W), y), once with lce_torch.linear_cross_entropy(h, W, y),
from the same initial weights on the same batches.

    python integrations/torch/examples/train_gpt.py [--steps 300] [--svg train_gpt.svg]

The corpus is synthetic: a random Markov chain over the vocabulary (each token allows 4
next tokens, with probabilities 1/k normalised), so the loss falls from about log(V)
towards the chain's entropy (1.24 nats). lce runs with an 8 MiB workspace limit, so its
chunk of logits stays below what the materialised path holds. Prints the loss of both runs every 25
steps, the largest step-by-step difference (the run fails if it exceeds --tolerance),
the peak memory of the loss step (LM head + loss, forward and backward) of each, and
writes an SVG plot of both curves and their difference.
"""
import argparse
import math
import os
import sys
import time
import warnings

# Large allocations straight from mmap, so that a freed tensor is returned to the OS and the
# peak RSS of one step (VmHWM, reset through /proc/self/clear_refs) measures that step alone.
if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and not os.environ.get("LCE_NO_REEXEC"):
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable] + sys.argv)

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lce_torch  # noqa: E402


# ---- model ------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, context):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Parameter(torch.randn(vocab, d) * d**-0.5)  # the LM head weight [V, d]

    def hidden(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln(x)  # [B, T, d]


def materialised_loss(h, w, y):
    return F.cross_entropy(F.linear(h, w).flatten(0, -2), y.flatten())


def lce_loss(h, w, y):
    return lce_torch.linear_cross_entropy(h, w, y, workspace_limit_bytes=8 << 20)


# ---- data -------------------------------------------------------------------------


def markov_corpus(vocab, tokens, branching, seed):
    """Token ids of a Markov chain: after token b comes one of `branching` ids of row b of a
    random table, the k-th with probability proportional to 1/k."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, branching), generator=g).tolist()
    probs = 1.0 / torch.arange(1, branching + 1, dtype=torch.float64)
    choice = torch.multinomial(probs / probs.sum(), tokens, replacement=True, generator=g).tolist()
    out = [0] * tokens
    b = 0
    for i in range(tokens):
        b = table[b][choice[i]]
        out[i] = b
    return torch.tensor(out, dtype=torch.long)


def batches(corpus, batch, context, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, corpus.numel() - context - 1, (batch,), generator=g)
        x = torch.stack([corpus[s:s + context] for s in starts])
        y = torch.stack([corpus[s + 1:s + context + 1] for s in starts])
        yield x, y


# ---- memory -------------------------------------------------------------------------


def rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_extra_bytes(fn):
    """Peak RSS growth while fn() runs (VmHWM after a reset, less the RSS before)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan")
    before = rss_kb("VmRSS")
    fn()
    return (rss_kb("VmHWM") - before) * 1024


def loss_step_peak(loss_fn, model, x, y):
    """Peak extra memory of the loss step alone: LM head + loss, forward and backward,
    from the (detached) final hidden states, as in the training step."""
    with torch.no_grad():
        h0 = model.hidden(x)
    h = h0.clone().requires_grad_(True)
    w = model.head.detach().clone().requires_grad_(True)

    def step():
        loss_fn(h, w, y).backward()

    step()  # warm-up (lazy initialisations)
    h.grad = w.grad = None
    return peak_extra_bytes(step)


# ---- training -----------------------------------------------------------------------


def train(loss_fn, args, corpus):
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses = []
    start = time.perf_counter()
    for x, y in batches(corpus, args.batch, args.context, args.steps, args.seed + 1):
        loss = loss_fn(model.hidden(x), model.head, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    x, y = next(batches(corpus, args.batch, args.context, 1, args.seed + 2))
    return losses, seconds, loss_step_peak(loss_fn, model, x, y)


# ---- plot -----------------------------------------------------------------------------


def svg_plot(path, curves, diff, title):
    """Two panels written by hand: the loss curves, and |difference| on a log scale."""
    width, height, pad = 760, 550, 60
    top_h, bottom_h = 280, 120
    steps = len(next(iter(curves.values())))
    lo = min(min(c) for c in curves.values())
    hi = max(max(c) for c in curves.values())
    lo, hi = math.floor(lo * 2) / 2, math.ceil(hi * 2) / 2

    def xs(i):
        return pad + (width - 2 * pad) * i / max(steps - 1, 1)

    def ys(v):
        return pad + top_h * (hi - v) / (hi - lo)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2}" y="24" text-anchor="middle" font-size="15">{title}</text>']
    # axes and grid of the loss panel
    v = lo
    while v <= hi + 1e-9:
        y = ys(v)
        out.append(f'<line x1="{pad}" y1="{y:.1f}" x2="{width - pad}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{pad - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.1f}</text>')
        v += 0.5
    for s in range(0, steps + 1, max(steps // 6, 1)):
        x = xs(min(s, steps - 1))
        out.append(f'<text x="{x:.1f}" y="{pad + top_h + 16}" text-anchor="middle">{s}</text>')
    out.append(f'<text x="16" y="{pad + top_h / 2}" transform="rotate(-90 16 {pad + top_h / 2})" '
               f'text-anchor="middle">training loss</text>')
    colours = {"materialised": "#1f77b4", "lce": "#d62728"}
    dashes = {"materialised": "", "lce": ' stroke-dasharray="6 4"'}
    for k, (name, c) in enumerate(curves.items()):
        pts = " ".join(f"{xs(i):.1f},{ys(v):.2f}" for i, v in enumerate(c))
        out.append(f'<polyline fill="none" stroke="{colours[name]}" stroke-width="1.6"{dashes[name]} points="{pts}"/>')
        out.append(f'<line x1="{width - pad - 190}" y1="{pad + 14 + 18 * k}" x2="{width - pad - 160}" '
                   f'y2="{pad + 14 + 18 * k}" stroke="{colours[name]}" stroke-width="2"{dashes[name]}/>')
        out.append(f'<text x="{width - pad - 154}" y="{pad + 18 + 18 * k}">{name}</text>')
    # the difference panel, log scale
    base = pad + top_h + 50
    floor, ceil = -9, -3
    out.append(f'<text x="{pad}" y="{base - 8}">|lce - materialised| per step (log scale)</text>')
    for e in range(floor, ceil + 1, 2):
        y = base + bottom_h * (ceil - e) / (ceil - floor)
        out.append(f'<line x1="{pad}" y1="{y:.1f}" x2="{width - pad}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{pad - 6}" y="{y + 4:.1f}" text-anchor="end">1e{e}</text>')
    pts = []
    for i, d in enumerate(diff):
        e = math.log10(max(d, 10.0**floor))
        pts.append(f"{xs(i):.1f},{base + bottom_h * (ceil - min(e, ceil)) / (ceil - floor):.2f}")
    out.append(f'<polyline fill="none" stroke="#555" stroke-width="1" points="{" ".join(pts)}"/>')
    out.append(f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle">step</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest allowed |loss_lce - loss_materialised| at any step")
    p.add_argument("--svg", default="train_gpt.svg")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    corpus = markov_corpus(args.vocab, 200_000, branching=4, seed=args.seed)
    print(f"GPT: vocab {args.vocab}, d {args.dim}, {args.layers} layers, {args.heads} heads, context {args.context}, "
          f"batch {args.batch} ({args.batch * args.context} tokens/step), {args.steps} steps, AdamW lr {args.lr}, "
          f"{args.threads} threads")
    print(lce_torch.blas_info())
    runs = {}
    for name, fn in (("materialised", materialised_loss), ("lce", lce_loss)):
        runs[name] = train(fn, args, corpus)
        losses, seconds, peak = runs[name]
        print(f"{name:>12}: {seconds:6.1f} s, final loss {losses[-1]:.4f}, loss-step peak extra memory "
              f"{peak / 2**20:7.1f} MiB")
    a, b = runs["materialised"][0], runs["lce"][0]
    diff = [abs(x - y) for x, y in zip(a, b)]
    print(f"{'step':>6} {'materialised':>13} {'lce':>10} {'|diff|':>9}")
    for i in list(range(0, args.steps, 25)) + [args.steps - 1]:
        print(f"{i:>6} {a[i]:>13.5f} {b[i]:>10.5f} {diff[i]:>9.2e}")
    worst = max(range(len(diff)), key=diff.__getitem__)
    print(f"largest |difference|: {diff[worst]:.2e} at step {worst} (tolerance {args.tolerance:g}); "
          f"mean {sum(diff) / len(diff):.2e}")
    m, l = runs["materialised"][2], runs["lce"][2]
    print(f"loss-step peak extra memory: materialised {m / 2**20:.1f} MiB, lce {l / 2**20:.1f} MiB "
          f"({m / max(l, 1):.1f}x less with lce); logits alone would be "
          f"{args.batch * args.context * args.vocab * 4 / 2**20:.1f} MiB")
    svg_plot(args.svg, {"materialised": a, "lce": b}, diff,
             f"GPT on a synthetic Markov corpus: materialised loss vs lce (V={args.vocab})")
    print(f"wrote {args.svg}")
    if diff[worst] > args.tolerance:
        print("FAIL: the curves differ by more than the tolerance", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
