# Finds the CUDA runtime, cuBLAS and CCCL (CUB) for lce::cuda and defines the
# imported target lce::cuda_runtime. Included by lce's own CMakeLists.txt and
# by the installed package config, so consumers re-find them on their machine.
# Nothing here enables the CUDA language: a consumer compiling lce's .cuh
# headers does so with nvcc in its own project.
#
# Sets LCE_CUDA_FOUND.
set(LCE_CUDA_FOUND FALSE)
if(NOT TARGET CUDA::cudart)
  find_package(CUDAToolkit QUIET)
endif()
if(TARGET CUDA::cudart AND TARGET CUDA::cublas)
  # CUB lives under include/cccl since CUDA 13; nvcc searches it itself, the
  # host compiler (and clangd) need it spelt out.
  find_path(LCE_CUB_INCLUDE_DIR cub/block/block_reduce.cuh
            HINTS ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES cccl NO_DEFAULT_PATH)
  mark_as_advanced(LCE_CUB_INCLUDE_DIR)
  if(LCE_CUB_INCLUDE_DIR)
    if(NOT TARGET lce::cuda_runtime)
      add_library(lce::cuda_runtime INTERFACE IMPORTED)
      set_target_properties(lce::cuda_runtime PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "${LCE_CUB_INCLUDE_DIR}"
        INTERFACE_LINK_LIBRARIES "CUDA::cublas;CUDA::cudart")
    endif()
    set(LCE_CUDA_FOUND TRUE)
  endif()
endif()
