"""Build of lce_torch: lce's operator as PyTorch custom ops (torch.ops.lce.*).

    pip install --no-build-isolation integrations/torch     # uses the installed torch

The C++ extension includes lce's headers from this repository (../../include,
or LCE_INCLUDE_DIR) and links OpenBLAS (pkg-config `openblas`, else
-lopenblas; LCE_TORCH_BLAS_LIBS overrides the link flags, e.g. "-lmkl_rt").
The losses (csrc/losses.cpp, lce's include/lce/loss/) need CCCL's Thrust,
which the CUDA toolkit ships under include/cccl: found as the project's CMake
finds it (LCE_CCCL_INCLUDE_DIR, else $CUDA_PATH, $CUDA_HOME, /usr/local/cuda),
compiled for the host (THRUST_DEVICE_SYSTEM_CPP; g++ only, no nvcc).
It is built with -O2 -march=native (LCE_TORCH_CXXFLAGS overrides the
optimisation flags): it is compiled on the machine it runs on.
"""
import os
import shlex
import subprocess

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

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

setup(
    ext_modules=[
        CppExtension(
            "lce_torch._C",
            sources=[os.path.join("csrc", f) for f in ("module.cpp", "register.cpp", "ops_full.cpp", "ops_half.cpp",
                                                               "losses.cpp")],
            include_dirs=include_dirs,
            # The losses' Thrust algorithms run on the host (thrust::host; no CUDA compiler here).
            define_macros=[("THRUST_DEVICE_SYSTEM", "THRUST_DEVICE_SYSTEM_CPP")],
            library_dirs=library_dirs,
            libraries=libraries,
            extra_compile_args=["-std=c++20", *opt, "-g0", "-Wno-deprecated-declarations"],
            extra_link_args=rpath,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
