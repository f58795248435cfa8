# Finds the CUDA runtime and NCCL for lce::nccl and defines the imported
# target lce::nccl_runtime. Included by lce's own CMakeLists.txt and by the
# installed package config, so consumers re-find them on their machine.
#
# Sets LCE_NCCL_FOUND.
set(LCE_NCCL_FOUND FALSE)
if(NOT TARGET CUDA::cudart)
  find_package(CUDAToolkit QUIET)
endif()
if(TARGET CUDA::cudart)
  find_path(LCE_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(LCE_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} "${CUDAToolkit_LIBRARY_ROOT}/lib"
               "${CUDAToolkit_LIBRARY_ROOT}/lib64")
  mark_as_advanced(LCE_NCCL_INCLUDE_DIR LCE_NCCL_LIBRARY)
  if(LCE_NCCL_INCLUDE_DIR AND LCE_NCCL_LIBRARY)
    if(NOT TARGET lce::nccl_runtime)
      add_library(lce::nccl_runtime INTERFACE IMPORTED)
      set_target_properties(lce::nccl_runtime PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "${LCE_NCCL_INCLUDE_DIR}"
        INTERFACE_LINK_LIBRARIES "${LCE_NCCL_LIBRARY};CUDA::cudart")
    endif()
    set(LCE_NCCL_FOUND TRUE)
  endif()
endif()
