"""Build of lce_torch: lce's operator as PyTorch custom ops (torch.ops.lce.*).

    pip install --no-build-isolation integrations/torch     # uses the installed torch

The C++ extension includes lce's headers from this repository (../../include,
or LCE_INCLUDE_DIR) and links OpenBLAS (pkg-config `openblas`, else
-lopenblas; LCE_TORCH_BLAS_LIBS overrides the link flags, e.g. "-lmkl_rt").
The losses (csrc/losses.cpp, lce's include/lce/loss/) need CCCL's Thrust,
which the CUDA toolkit ships under include/cccl: found as the project's CMake
finds it (LCE_CCCL_INCLUDE_DIR, else $CUDA_PATH, $CUDA_HOME, /usr/local/cuda),
compiled for the host (THRUST_DEVICE_SYSTEM_CPP).
It is built with -O2 -march=native (LCE_TORCH_CXXFLAGS overrides the
optimisation flags): it is compiled on the machine it runs on.

CUDA tensors: where this torch is a CUDA build and the CUDA toolkit (nvcc,
found as torch finds it: CUDA_HOME) is here, the ops also get CUDA kernels on
lce's CUDA backend (csrc/cuda_ops.cu, compiled by nvcc for TORCH_CUDA_ARCH_LIST,
or for this machine's GPUs, or for 9.0 when it has none). LCE_TORCH_CUDA=0
builds without them, LCE_TORCH_CUDA=1 insists; without a CUDA torch, nvcc, or with an
nvcc of another major version than torch's CUDA, it builds without them and says why.
"""
import os
import shlex
import subprocess

from setuptools import setup
import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))
lce_include = os.environ.get("LCE_INCLUDE_DIR", os.path.join(here, "..", "..", "include"))
if not os.path.exists(os.path.join(lce_include, "lce", "lce.hpp")):
    raise RuntimeError(f"lce headers not found at {lce_include}: set LCE_INCLUDE_DIR to lce's include/")


def find_cccl_include():
    """The directory holding CCCL's thrust/ (the CUDA toolkit's include/cccl), as
    tests/CMakeLists.txt finds CCCL (its CMake config under <toolkit>/lib64/cmake, whose
    include directory is <toolkit>/include/cccl)."""
    if "LCE_CCCL_INCLUDE_DIR" in os.environ:
        candidates = [os.environ["LCE_CCCL_INCLUDE_DIR"]]
    else:
        roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
        candidates = [os.path.join(r, "include", "cccl") for r in roots if r]
    for c in candidates:
        if os.path.exists(os.path.join(c, "thrust", "version.h")):
            return os.path.abspath(c)
    raise RuntimeError(
        "lce_torch: CCCL (Thrust) not found in " + ", ".join(candidates) + ": the losses (include/lce/loss) need it. "
        "Install the CUDA toolkit (it ships CCCL under include/cccl; no GPU needed) or point LCE_CCCL_INCLUDE_DIR "
        "at a directory holding thrust/version.h")


cccl_include = find_cccl_include()


def pkg_config(*args):
    try:
        out = subprocess.run(["pkg-config", *args, "openblas"], check=True, capture_output=True, text=True)
        return shlex.split(out.stdout)
    except (OSError, subprocess.CalledProcessError):
        return None


cflags = pkg_config("--cflags") or []
include_dirs = [os.path.abspath(lce_include), cccl_include] + [f[2:] for f in cflags if f.startswith("-I")]
if "LCE_TORCH_BLAS_LIBS" in os.environ:
    blas_libs = shlex.split(os.environ["LCE_TORCH_BLAS_LIBS"])
else:
    blas_libs = pkg_config("--libs") or ["-lopenblas"]
library_dirs = [f[2:] for f in blas_libs if f.startswith("-L")]
libraries = [f[2:] for f in blas_libs if f.startswith("-l")]
# The BLAS's directory on the run-time search path too (pkg-config's -L is not one of the default ones).
rpath = [f"-Wl,-rpath,{d}" for d in library_dirs]

opt = shlex.split(os.environ.get("LCE_TORCH_CXXFLAGS", "-O2 -march=native"))


def with_cuda():
    """Whether to build the CUDA kernels (see the module's docstring)."""
    setting = os.environ.get("LCE_TORCH_CUDA", "auto")
    if setting == "0":
        return False
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    why = None
    if torch.version.cuda is None:
        why = "this torch is not a CUDA build"
    elif nvcc is None or not os.path.exists(nvcc):
        why = f"no nvcc under CUDA_HOME (= {CUDA_HOME})"
    else:
        # torch refuses to build with a toolkit of another major version than its own.
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        release = out.split("release ")[-1].split(",")[0] if "release " in out else "?"
        if release.split(".")[0] != torch.version.cuda.split(".")[0]:
            why = f"nvcc {release} is not CUDA {torch.version.cuda.split('.')[0]}, torch's ({torch.version.cuda})"
    if why and setting == "1":
        raise RuntimeError(f"LCE_TORCH_CUDA=1: cannot build the CUDA kernels: {why}")
    if why:
        print(f"lce_torch: building without CUDA kernels: {why}")
    return why is None


sources = [os.path.join("csrc", f) for f in ("module.cpp", "register.cpp", "ops_full.cpp", "ops_half.cpp", "losses.cpp")]
cxx_flags = ["-std=c++20", *opt, "-g0", "-Wno-deprecated-declarations"]
# The losses' Thrust algorithms run on the host (thrust::host).
macros = [("THRUST_DEVICE_SYSTEM", "THRUST_DEVICE_SYSTEM_CPP")]
common = dict(include_dirs=include_dirs, library_dirs=library_dirs, libraries=libraries, extra_link_args=rpath)
if with_cuda():
    if "TORCH_CUDA_ARCH_LIST" not in os.environ and torch.cuda.device_count() == 0:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"  # no GPU here to build for: compile for one
    extension = CUDAExtension(
        "lce_torch._C",
        sources=sources + [os.path.join("csrc", "cuda_ops.cu")],
        define_macros=macros + [("LCE_TORCH_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-std=c++20", "-O2"]},
        libraries=libraries + ["cublas"],
        **{k: v for k, v in common.items() if k != "libraries"},
    )
else:
    extension = CppExtension("lce_torch._C", sources=sources, define_macros=macros, extra_compile_args=cxx_flags,
                             **common)

setup(ext_modules=[extension], cmdclass={"build_ext": BuildExtension})
