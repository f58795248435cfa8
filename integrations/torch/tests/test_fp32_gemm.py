"""fp32/fp64 GEMMs of lce_torch (csrc/torch_gemm.hpp): lce's OpenBLAS, or the sgemm/dgemm of
the MKL inside libtorch_cpu on an Intel CPU and where that OpenBLAS runs kernels slower than
the CPU allows (LCE_TORCH_FP32_BLAS=mkl or =openblas forces a choice; it is read once per process, so each
choice runs in a child). All three GEMMs of a chunk (logits x W^T, dz W, dz^T x) take part,
so a swapped operand, transpose or leading dimension is off by O(1) against the reference."""
import os

import pytest
import torch

import lce_torch
from conftest import GRAD_TOL, HAS_MKL, TOL, cpuinfo, reference_row_gradients, run_child

HERE = os.path.dirname(os.path.abspath(__file__))

# One problem with a ragged chunk and an ignored target; results saved as float64.
SCRIPT = r"""
import sys, torch, lce_torch
sys.path.insert(0, {here!r})
from conftest import make
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[2])
h, w, y = make(150, 96, 3001, dtype, seed=7, ignore=(3,), scale=2.0)
h.requires_grad_(True); w.requires_grad_(True)
logp, ent = lce_torch.linear_logprobs(h, w, y, with_entropy=True, chunk_tokens=64)
(logp.sum() * 0.5 + (ent * torch.linspace(-1, 1, ent.numel(), dtype=dtype)).sum()).backward()
torch.save(dict(info=lce_torch.blas_info(), logp=logp.detach().double(), ent=ent.detach().double(),
                dh=h.grad.double(), dw=w.grad.double()), sys.argv[1])
"""


PROBLEM = (150, 96, 3001, dict(seed=7, ignore=(3,), scale=2.0))


def run_fp_child(path, dtype, choice):
    return run_child(SCRIPT.format(here=HERE), path, {"LCE_TORCH_FP32_BLAS": choice}, str(dtype).split(".")[1])


def reference_results(dtype):
    return reference_row_gradients(PROBLEM, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("choice", ["mkl", "openblas"])
def test_each_fp32_gemm_provider_matches_the_float64_reference(tmp_path, dtype, choice):
    if choice == "mkl" and not HAS_MKL:
        pytest.skip("no MKL in this torch: fp32 GEMMs always run on lce's BLAS")
    got = run_fp_child(str(tmp_path / "out.pt"), dtype, choice)
    assert ("fp32/fp64 GEMMs: MKL's sgemm/dgemm" in got["info"]) == (choice == "mkl"), got["info"]
    want = reference_results(dtype)
    for key in ("logp", "ent"):
        torch.testing.assert_close(got[key], want[key], **TOL[dtype])
    for key in ("dh", "dw"):
        torch.testing.assert_close(got[key], want[key], **GRAD_TOL[dtype])


@pytest.mark.parametrize("kernels", ["Prescott", "matching"])
def test_default_runs_mkl_on_intel_and_where_openblas_kernels_are_slow(tmp_path, monkeypatch, kernels):
    """OPENBLAS_CORETYPE picks OpenBLAS's kernels in the child: SSE3 ones on an AVX2/AVX-512 CPU
    must send fp32 to MKL; the CPU's own class must keep OpenBLAS, except on an Intel CPU
    (MKL, as PyTorch's own fp32 matmuls)."""
    flags = cpuinfo("flags")
    if not HAS_MKL or "avx2" not in flags:
        pytest.skip("needs x86-64 with AVX2 and a torch with MKL")
    coretype = kernels if kernels == "Prescott" else ("SkylakeX" if "avx512f" in flags else "Haswell")
    monkeypatch.setenv("OPENBLAS_CORETYPE", coretype)
    got = run_fp_child(str(tmp_path / "out.pt"), torch.float32, None)
    if f"kernels {coretype} " not in got["info"]:
        pytest.skip(f"this OpenBLAS does not take OPENBLAS_CORETYPE: {got['info']}")
    on_mkl = "fp32/fp64 GEMMs: MKL's sgemm/dgemm" in got["info"]
    intel = cpuinfo("vendor_id") == ["GenuineIntel"]
    assert on_mkl == (kernels == "Prescott" or intel), got["info"]
    if on_mkl:
        reason = "OpenBLAS" if kernels == "Prescott" else "an Intel CPU"
        assert f"fp32/fp64 GEMMs: MKL's sgemm/dgemm from libtorch_cpu ({reason}" in got["info"], got["info"]
    assert "SLOW" not in got["info"], got["info"]
    want = reference_results(torch.float32)
    for key in ("dh", "dw"):
        torch.testing.assert_close(got[key], want[key], **GRAD_TOL[torch.float32])
