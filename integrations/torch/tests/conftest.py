import datetime
import os
import subprocess
import sys
import tempfile
import traceback
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import pytest  # noqa: E402
import torch  # noqa: E402

import lce_torch  # noqa: E402,F401


def pytest_configure(config):
    # scripts/gpu-check.sh sets LCE_TORCH_REQUIRE_CUDA=1: there, CUDA tests skipped for want
    # of a device or of a CUDA build would be a GPU check that checked nothing.
    if os.environ.get("LCE_TORCH_REQUIRE_CUDA") == "1":
        if not torch.cuda.is_available():
            raise pytest.UsageError("LCE_TORCH_REQUIRE_CUDA=1, but torch finds no CUDA device")
        if not lce_torch.built_with_cuda():
            raise pytest.UsageError("LCE_TORCH_REQUIRE_CUDA=1, but this lce_torch was built without CUDA")


# PyTorch's x86 wheels carry MKL inside libtorch_cpu (lce_torch's GEMMs can call it).
HAS_MKL = torch.backends.mkl.is_available() and os.uname().machine == "x86_64"


def cpuinfo(field):
    """The words of /proc/cpuinfo's first `field` line ("flags", "vendor_id"), or []."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith(field)), [])
    except OSError:
        return []


def reference(hidden, weight, targets, *, vocab_start=0, ignore_index=-100, temperature=1.0, softcap=0.0):
    """Materialised float64 reference: logprobs, lse, entropy (0 where ignored), differentiable."""
    # lce's options hold temperature and softcap as float32.
    temperature = float(torch.tensor(temperature, dtype=torch.float32))
    softcap = float(torch.tensor(softcap, dtype=torch.float32))
    z = hidden.double() @ weight.double().T
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logsm = torch.log_softmax(z, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets - vocab_start, torch.zeros_like(targets)).long()
    logp = torch.where(valid, logsm.gather(-1, safe.unsqueeze(-1)).squeeze(-1), torch.zeros((), dtype=z.dtype))
    lse = torch.logsumexp(z, dim=-1)
    ent = torch.where(valid, -(logsm.exp() * logsm).sum(-1), torch.zeros((), dtype=z.dtype))
    return logp, lse, ent


def make(n, h, v, dtype=torch.float32, seed=0, ignore=(), scale=1.0, shape=None, target_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    for i in ignore:
        targets[i] = -100
    if shape is not None:
        hidden = hidden.reshape(*shape, h)
        targets = targets.reshape(shape)
    return hidden, weight, targets.to(target_dtype)


# Tolerances of each dtype against the float64 reference (lce computes in fp32 from the
# 2-byte values, so it is close to the reference of the rounded inputs).
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-4, rtol=2e-4),
    torch.float16: dict(atol=2e-4, rtol=2e-4),
}
# Gradients of 2-byte dtypes are rounded to that dtype.
GRAD_TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


# A float64 saved by a child: options read once per process (LCE_TORCH_BF16_GEMM,
# LCE_TORCH_FP32_BLAS) take one child per setting. `script` gets the output path as
# sys.argv[1] and `args` after it; `env` entries set (or, with None, remove) variables.
def run_child(script, path, env, *args):
    child_env = dict(os.environ)
    for key, value in env.items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    subprocess.run([sys.executable, "-c", script, path, *args], check=True, env=child_env, timeout=300)
    return torch.load(path)


def reference_row_gradients(problem, dtype):
    """float64 logp, entropy and the gradients of 0.5 sum(logp) + sum(linspace(-1, 1) * entropy)
    for make(*problem[:3], dtype, **problem[3]) — the loss the children back-propagate."""
    n, h, v, kw = problem
    hidden, weight, targets = make(n, h, v, dtype, **kw)
    hr, wr = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp, _, ent = reference(hr, wr, targets)
    (logp.sum() * 0.5 + (ent * torch.linspace(-1, 1, ent.numel(), dtype=torch.float64)).sum()).backward()
    return dict(logp=logp.detach(), ent=ent.detach(), dh=hr.grad, dw=wr.grad)


# ---- several processes (torch.distributed) ------------------------------------


def init_group(rank, world, init_file, backend="gloo"):
    """Joins a spawned rank to the world and returns a group of every rank other than the
    default one, so that lce resolves it by its own name."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)  # a hang fails the test in minutes, not the default 30
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    return dist.new_group(list(range(world)), timeout=timeout)


def _rank_main(rank, body, world, init_file, error_dir, args):
    import torch.distributed as dist

    try:
        body(rank, world, init_file, *args)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def spawn_ranks(body, world, *args):
    """Runs body(rank, world, init_file, *args) in `world` processes (a module-level function:
    each process imports it); when one fails, the test fails with every failed rank's traceback."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_rank_main, args=(body, world, os.path.join(tmp, "init"), tmp, args), nprocs=world, join=True)
        except Exception:
            errors = "".join(open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.startswith("rank"))
            pytest.fail(f"a rank failed:\n{errors}")
