"""bfloat16 GEMMs of lce_torch (csrc/torch_gemm.hpp): lce's own kernel on AMX tiles (the
default on a CPU with AMX) or on AVX512-BF16 (the default on other CPUs with it), MKL's bf16
x bf16 -> fp32 GEMM from the libtorch_cpu this process loaded, or the weight widened to fp32
for OpenBLAS with dz in fp32 (the default without bf16 instructions; LCE_TORCH_BF16_GEMM=
amx|avx512bf16|mkl|widen asks for one). Each gives the float64 reference's gradients to within dz's
rounding to bf16, and the widened path's to within the outputs' bf16 rounding."""

import os

import pytest
import torch

import lce_torch
from conftest import HAS_MKL, cpuinfo, make, reference_row_gradients, run_child

HERE = os.path.dirname(os.path.abspath(__file__))

# One bf16 problem, its results saved as float64 (run here and in a child process).
SCRIPT = r"""
import sys, torch, lce_torch
sys.path.insert(0, {here!r})
from conftest import make
torch.set_num_threads(2)
h, w, y = make(150, 96, 3000, torch.bfloat16, seed=5, ignore=(4,), scale=2.0)
h.requires_grad_(True); w.requires_grad_(True)
logp, ent = lce_torch.linear_logprobs(h, w, y, with_entropy=True, chunk_tokens=64)
(logp.sum() * 0.5 + (ent * torch.linspace(-1, 1, ent.numel())).sum()).backward()
torch.save(dict(info=lce_torch.blas_info(), logp=logp.detach().double(), ent=ent.detach().double(),
                dh=h.grad.double(), dw=w.grad.double()), sys.argv[1])
"""


PROBLEM = (150, 96, 3000, dict(seed=5, ignore=(4,), scale=2.0))


def cpu_has_amx():
    flags = cpuinfo("flags")
    return "amx_bf16" in flags and "amx_tile" in flags


# What blas_info says for each path.
MARKS = {
    "amx": "lce's own kernel on AMX",
    "avx512bf16": "lce's own kernel on AVX512-BF16",
    "mkl": "cblas_gemm_bf16bf16f32",
    "widen": "widened to fp32",
}


def cpu_has_bf16_instructions():
    return "avx512_bf16" in cpuinfo("flags")


def default_kernel():
    # lce's own kernel where the CPU has AMX, else where it has AVX512-BF16; else widening
    # (MKL's bf16 GEMM emulates bf16 instructions there, slower than widening).
    if cpu_has_amx():
        return "amx"
    return "avx512bf16" if cpu_has_bf16_instructions() else "widen"


def run_bf16_child(path, kernel):
    return run_child(SCRIPT.format(here=HERE), path, {"LCE_TORCH_BF16_GEMM": kernel})


def skip_unless_available(kernel):
    if kernel == "amx" and not cpu_has_amx():
        pytest.skip("this CPU has no AMX: lce's kernel on AMX does not run here")
    if kernel == "avx512bf16" and not cpu_has_bf16_instructions():
        pytest.skip("this CPU has no AVX512-BF16: lce's kernel on it does not run here")
    if kernel == "mkl" and not HAS_MKL:
        pytest.skip("no MKL in this torch")


def reference_gradients():
    r = reference_row_gradients(PROBLEM, torch.bfloat16)
    return r["logp"], r["ent"], r["dh"], r["dw"]


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


def test_blas_info_names_the_bf16_gemm():
    info = lce_torch.blas_info()
    assert "bf16 GEMMs: " in info
    assert MARKS[default_kernel()] in info, info


@pytest.mark.parametrize("kernel", ["amx", "avx512bf16", "mkl", "widen"])
def test_bf16_gemm_paths_match_the_float64_reference(tmp_path, kernel):
    skip_unless_available(kernel)
    got = run_bf16_child(str(tmp_path / "out.pt"), kernel)
    assert MARKS[kernel] in got["info"], got["info"]
    rl, rent, rdh, rdw = reference_gradients()
    # Forward: fp32 from exact bf16 products, so to fp32 rounding.
    torch.testing.assert_close(got["logp"], rl, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got["ent"], rent, atol=2e-4, rtol=2e-4)
    # Gradients: dz rounded to bf16 (2^-8) and the outputs rounded to bf16 (2^-8): well under 1%,
    # well over fp32's rounding (a wrong GEMM, transpose or missing term is off by O(1)).
    assert relative_error(got["dh"], rdh) < 5e-3
    assert relative_error(got["dw"], rdw) < 5e-3


def test_widened_path_keeps_dz_in_fp32(tmp_path):
    """Widening (the default without bf16 instructions) runs the host backend's own fp32 path:
    the weight widened, dz kept in fp32, so the gradients are the float64 reference's rounded
    to bf16 but for rounding ties (dz rounded to bf16 first is 1e-3 off, rms)."""
    got = run_bf16_child(str(tmp_path / "out.pt"), "widen")
    assert MARKS["widen"] in got["info"] and "dz in fp32" in got["info"], got["info"]
    _, _, rdh, rdw = reference_gradients()
    assert relative_error(got["dh"], rdh.bfloat16().double()) < 3e-4
    assert relative_error(got["dw"], rdw.bfloat16().double()) < 3e-4


@pytest.mark.parametrize("kernel", ["amx", "avx512bf16", "mkl"])
def test_bf16_kernel_and_widened_paths_agree(tmp_path, kernel):
    skip_unless_available(kernel)
    fast = run_bf16_child(str(tmp_path / "fast.pt"), kernel)
    widened = run_bf16_child(str(tmp_path / "widened.pt"), "widen")
    assert MARKS[kernel] in fast["info"] and MARKS["widen"] in widened["info"]
    # Same products, same dz rounding; only the fp32 summation order differs.
    torch.testing.assert_close(fast["logp"], widened["logp"], atol=1e-5, rtol=1e-5)
    for key in ("dh", "dw"):
        scale = float(widened[key].abs().max())
        torch.testing.assert_close(fast[key], widened[key], atol=2e-2 * scale, rtol=8e-3)


def test_set_bf16_gemm_switches_kernels_between_calls():
    """Each kernel this machine runs, chosen in one process, gives the widened path's results."""
    h, w, y = make(70, 64, 1500, torch.bfloat16, seed=9, scale=2.0)
    results = {}
    try:
        for kernel in ("widen", "mkl", "amx", "avx512bf16"):
            if lce_torch.set_bf16_gemm(kernel) != kernel:
                continue  # not on this machine: the default runs instead
            assert MARKS[kernel] in lce_torch.blas_info()
            hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            logp = lce_torch.linear_logprobs(hh, ww, y, chunk_tokens=32)
            logp.sum().backward()
            results[kernel] = (logp.detach().double(), hh.grad.double(), ww.grad.double())
    finally:
        default = lce_torch.set_bf16_gemm("auto")
    assert default == default_kernel()
    assert "widen" in results
    assert len(results) == 1 + HAS_MKL + cpu_has_amx() + cpu_has_bf16_instructions()
    ref = results["widen"]
    for kernel, got in results.items():
        torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
        for g, r in zip(got[1:], ref[1:]):
            torch.testing.assert_close(g, r, atol=2e-2 * float(r.abs().max()), rtol=8e-3)


def test_set_bf16_gemm_rejects_unknown_kernels():
    with pytest.raises(ValueError, match="kernel is \"fast\"; expected \"amx\""):
        lce_torch.set_bf16_gemm("fast")
    with pytest.raises(ValueError, match="kernel is \"fast\"; expected \"amx\""):  # std::invalid_argument
        torch.ops.lce.set_bf16_gemm("fast")
    assert MARKS[default_kernel()] in lce_torch.blas_info()
