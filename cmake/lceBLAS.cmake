# lceBLAS.cmake — find a CBLAS for lce's host backend and expose it as the
# imported INTERFACE target `lce::blas` (include dirs + libraries).
#
# Used twice: by lce's own CMakeLists.txt, and (installed next to
# lceConfig.cmake) by the package config, so consumers re-find the BLAS on
# their machine instead of inheriting paths from the machine lce was built on.
#
# Which BLAS: the cache variable LCE_BLAS (set it before find_package(lce) or
# add_subdirectory, or with -DLCE_BLAS=... on the command line):
#   auto      (default) OpenBLAS if found, else any CBLAS FindBLAS finds
#   openblas  pkg-config module `openblas` (Debian: libopenblas-dev), else FindBLAS
#             with BLA_VENDOR=OpenBLAS
#   blis      BLIS (Debian: libblis-dev; pkg-config `blis`, else libblis + its cblas.h)
#   mkl       oneMKL, sequential LP64 (pkg-config `mkl-dynamic-lp64-seq`: point
#             PKG_CONFIG_PATH at <prefix>/lib/pkgconfig, e.g. of `pip install mkl-devel`,
#             or set MKLROOT); a cblas.h forwarding to mkl_cblas.h is generated
#   generic   FindBLAS (BLA_VENDOR as the caller set it) + cblas.h
#
# OpenBLAS stays the default: it is what Debian users have, and with the kernels the
# CPU allows it is the fastest BLAS a plain `apt-get install` brings (bench/blas_compare.sh
# measures every BLAS side by side; README "The BLAS" has the numbers). OpenBLAS 0.3.21
# on a CPU model it does not know runs SSE3 "Prescott" kernels 4-5x slower: lce's
# programs and scripts set OPENBLAS_CORETYPE (lce::reexec_with_fast_blas,
# scripts/blas-coretype.sh) and lce::blas_info() tells any program what runs.
#
# lce calls single-threaded GEMMs from its own threads. With OpenBLAS it sets
# openblas_set_num_threads(1) around its calls; MKL is linked sequential here;
# with BLIS set BLIS_NUM_THREADS=1 (or use its serial build) until the backend does so.
#
# Results: target lce::blas (with ${CMAKE_DL_LIBS}, which lce::blas_info's dlsym
# needs on old glibc, and one compile definition LCE_BLAS_OPENBLAS, LCE_BLAS_BLIS,
# LCE_BLAS_MKL or LCE_BLAS_GENERIC), LCE_BLAS_FOUND (TRUE/FALSE) and LCE_BLAS_VENDOR
# (openblas, blis, mkl, generic). On failure LCE_BLAS_NOT_FOUND_MESSAGE holds a message
# for the caller to report; this file never raises a FATAL_ERROR itself, so
# find_package(lce QUIET) stays quiet.

if(TARGET lce::blas)
  set(LCE_BLAS_FOUND TRUE)
  return()
endif()

set(LCE_BLAS "auto" CACHE STRING "BLAS for lce's host backend: auto, openblas, blis, mkl or generic")
set_property(CACHE LCE_BLAS PROPERTY STRINGS auto openblas blis mkl generic)
string(TOLOWER "${LCE_BLAS}" _lce_blas_want)
if(NOT _lce_blas_want MATCHES "^(auto|openblas|blis|mkl|generic)$")
  set(LCE_BLAS_FOUND FALSE)
  set(LCE_BLAS_NOT_FOUND_MESSAGE
    "LCE_BLAS = '${LCE_BLAS}' is not one of auto, openblas, blis, mkl, generic")
  unset(_lce_blas_want)
  return()
endif()

set(LCE_BLAS_FOUND FALSE)
set(LCE_BLAS_VENDOR "")
set(_lce_blas_how "")
set(_lce_blas_arch_dirs x86_64-linux-gnu aarch64-linux-gnu powerpc64le-linux-gnu s390x-linux-gnu)

find_package(PkgConfig QUIET)

# lce::blas from a library target/list and an include dir (cblas.h).
function(_lce_blas_define vendor libraries include_dir how)
  add_library(lce::blas INTERFACE IMPORTED)
  string(TOUPPER "${vendor}" _upper)
  set_target_properties(lce::blas PROPERTIES
    INTERFACE_LINK_LIBRARIES "${libraries};${CMAKE_DL_LIBS}"
    INTERFACE_COMPILE_DEFINITIONS "LCE_BLAS_${_upper}=1")
  if(include_dir)
    set_property(TARGET lce::blas PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${include_dir}")
  endif()
  set(LCE_BLAS_VENDOR "${vendor}" PARENT_SCOPE)
  set(_lce_blas_how "${how}" PARENT_SCOPE)
endfunction()

# --- OpenBLAS: pkg-config, then FindBLAS(OpenBLAS) ------------------------------
if(_lce_blas_want MATCHES "^(auto|openblas)$" AND PKG_CONFIG_FOUND)
  pkg_check_modules(LCE_OPENBLAS QUIET IMPORTED_TARGET openblas)
  if(LCE_OPENBLAS_FOUND AND TARGET PkgConfig::LCE_OPENBLAS)
    # Debian's openblas.pc puts cblas.h on the include path; check anyway.
    find_path(LCE_CBLAS_INCLUDE_DIR cblas.h HINTS ${LCE_OPENBLAS_INCLUDE_DIRS} NO_DEFAULT_PATH)
    if(LCE_CBLAS_INCLUDE_DIR)
      _lce_blas_define(openblas PkgConfig::LCE_OPENBLAS "" "pkg-config openblas ${LCE_OPENBLAS_VERSION}")
    else()
      unset(LCE_CBLAS_INCLUDE_DIR CACHE)
    endif()
  endif()
endif()

# --- BLIS: pkg-config blis, then libblis + the cblas.h next to blis.h --------------
if(_lce_blas_want STREQUAL "blis")
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(LCE_BLIS QUIET IMPORTED_TARGET blis)
  endif()
  set(_lce_blis_suffixes blis)
  foreach(_arch IN LISTS _lce_blas_arch_dirs)
    list(APPEND _lce_blis_suffixes ${_arch}/blis-pthread ${_arch}/blis-openmp ${_arch}/blis-serial)
  endforeach()
  # BLIS's own cblas.h, the one beside its blis.h (a distribution's cblas.h in the
  # plain include folder may be another BLAS's).
  if(LCE_BLIS_FOUND AND TARGET PkgConfig::LCE_BLIS)
    find_path(LCE_BLIS_CBLAS_INCLUDE_DIR NAMES blis.h HINTS ${LCE_BLIS_INCLUDE_DIRS} PATH_SUFFIXES blis)
    set(_lce_blis_lib PkgConfig::LCE_BLIS)
  else()
    find_library(LCE_BLIS_LIBRARY NAMES blis libblis.so.4 PATH_SUFFIXES ${_lce_blis_suffixes})
    # Debian: /usr/include/<arch>/blis-{pthread,openmp,serial}/ hold blis.h with its cblas.h
    # (/usr/include/<arch>/cblas.h is whichever BLAS the alternatives system chose).
    find_path(LCE_BLIS_CBLAS_INCLUDE_DIR NAMES blis.h PATH_SUFFIXES ${_lce_blis_suffixes} NO_CMAKE_SYSTEM_PATH)
    foreach(_arch IN LISTS _lce_blas_arch_dirs)
      foreach(_flavour pthread openmp serial)
        find_path(LCE_BLIS_CBLAS_INCLUDE_DIR NAMES blis.h cblas.h NO_DEFAULT_PATH
          PATHS /usr/include/${_arch}/blis-${_flavour})
      endforeach()
    endforeach()
    find_path(LCE_BLIS_CBLAS_INCLUDE_DIR NAMES blis.h PATH_SUFFIXES blis)
    set(_lce_blis_lib "${LCE_BLIS_LIBRARY}")
  endif()
  if(LCE_BLIS_CBLAS_INCLUDE_DIR AND NOT EXISTS "${LCE_BLIS_CBLAS_INCLUDE_DIR}/cblas.h")
    set(_lce_blis_lib "")  # a BLIS built without its CBLAS layer
  endif()
  if(_lce_blis_lib AND LCE_BLIS_CBLAS_INCLUDE_DIR)
    set(THREADS_PREFER_PTHREAD_FLAG ON)
    find_package(Threads QUIET)
    _lce_blas_define(blis "${_lce_blis_lib};Threads::Threads" "${LCE_BLIS_CBLAS_INCLUDE_DIR}"
      "BLIS (${_lce_blis_lib}), cblas.h in ${LCE_BLIS_CBLAS_INCLUDE_DIR}")
  endif()
  unset(_lce_blis_lib)
  unset(_lce_blis_suffixes)
endif()

# --- MKL: sequential LP64 (lce runs its own threads) -------------------------------
# The libraries are found by name in the pkg-config module's libdir (or MKLROOT): the
# module lists them as full paths, which CMake's pkg-config targets put before the
# objects on the link line, where --as-needed drops them. pip's wheels ship only the
# versioned files (libmkl_core.so.2 or .so.3).
if(_lce_blas_want STREQUAL "mkl")
  set(_lce_mkl_libdirs "")
  set(_lce_mkl_incdirs "")
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(LCE_MKL QUIET mkl-dynamic-lp64-seq)
    if(LCE_MKL_FOUND)
      pkg_get_variable(_lce_mkl_pc_libdir mkl-dynamic-lp64-seq libdir)
      pkg_get_variable(_lce_mkl_pc_incdir mkl-dynamic-lp64-seq includedir)
      list(APPEND _lce_mkl_libdirs "${_lce_mkl_pc_libdir}")
      list(APPEND _lce_mkl_incdirs "${_lce_mkl_pc_incdir}" ${LCE_MKL_INCLUDE_DIRS})
    endif()
  endif()
  if(DEFINED ENV{MKLROOT})
    list(APPEND _lce_mkl_libdirs "$ENV{MKLROOT}/lib" "$ENV{MKLROOT}/lib/intel64")
    list(APPEND _lce_mkl_incdirs "$ENV{MKLROOT}/include")
  endif()
  find_path(LCE_MKL_INCLUDE_DIR mkl_cblas.h HINTS ${_lce_mkl_incdirs})
  set(_lce_mkl_libs "")
  foreach(_part intel_lp64 sequential core)
    find_library(LCE_MKL_${_part}_LIBRARY
      NAMES mkl_${_part} libmkl_${_part}.so.3 libmkl_${_part}.so.2 libmkl_${_part}.so.1
      HINTS ${_lce_mkl_libdirs})
    if(LCE_MKL_${_part}_LIBRARY)
      list(APPEND _lce_mkl_libs "${LCE_MKL_${_part}_LIBRARY}")
    else()
      set(_lce_mkl_libs "")
      break()
    endif()
  endforeach()
  if(LCE_MKL_INCLUDE_DIR AND _lce_mkl_libs)
    # MKL ships mkl_cblas.h, not cblas.h: give lce (and its consumers) a forwarder.
    set(_lce_mkl_shim "${CMAKE_CURRENT_BINARY_DIR}/lce_mkl_cblas")
    file(WRITE "${_lce_mkl_shim}/cblas.h.tmp"
      "/* generated by lceBLAS.cmake (LCE_BLAS=mkl) */\n#pragma once\n#include <mkl_cblas.h>\n")
    file(COPY_FILE "${_lce_mkl_shim}/cblas.h.tmp" "${_lce_mkl_shim}/cblas.h" ONLY_IF_DIFFERENT)
    set(THREADS_PREFER_PTHREAD_FLAG ON)
    find_package(Threads QUIET)
    _lce_blas_define(mkl "${_lce_mkl_libs};Threads::Threads;m" "${_lce_mkl_shim};${LCE_MKL_INCLUDE_DIR}"
      "oneMKL sequential (${LCE_MKL_core_LIBRARY}), mkl_cblas.h in ${LCE_MKL_INCLUDE_DIR}")
    unset(_lce_mkl_shim)
  endif()
  unset(_lce_mkl_libs)
  unset(_lce_mkl_libdirs)
  unset(_lce_mkl_incdirs)
endif()

# --- FindBLAS + cblas.h (generic; auto's fallback; openblas's second try) --------
if(NOT TARGET lce::blas AND _lce_blas_want MATCHES "^(auto|openblas|generic)$")
  if(_lce_blas_want STREQUAL "openblas" AND NOT DEFINED BLA_VENDOR)
    set(BLA_VENDOR OpenBLAS)
    set(_lce_blas_unset_vendor TRUE)
  endif()
  find_package(BLAS QUIET)
  if(_lce_blas_unset_vendor)
    unset(BLA_VENDOR)
    unset(_lce_blas_unset_vendor)
  endif()
  if(BLAS_FOUND)
    set(_lce_cblas_suffixes openblas cblas)
    foreach(_arch IN LISTS _lce_blas_arch_dirs)
      list(APPEND _lce_cblas_suffixes ${_arch}/openblas-pthread ${_arch}/openblas-openmp
                                      ${_arch}/openblas-serial ${_arch})
    endforeach()
    find_path(LCE_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES ${_lce_cblas_suffixes})
    unset(_lce_cblas_suffixes)
    if(LCE_CBLAS_INCLUDE_DIR)
      if(TARGET BLAS::BLAS)
        set(_lce_blas_libs BLAS::BLAS)
      else()
        set(_lce_blas_libs ${BLAS_LIBRARIES} ${BLAS_LINKER_FLAGS})
      endif()
      set(_lce_vendor generic)
      if(_lce_blas_want STREQUAL "openblas" OR BLAS_LIBRARIES MATCHES "openblas")
        set(_lce_vendor openblas)
      endif()
      _lce_blas_define(${_lce_vendor} "${_lce_blas_libs}" "${LCE_CBLAS_INCLUDE_DIR}"
        "FindBLAS (${BLAS_LIBRARIES}), cblas.h in ${LCE_CBLAS_INCLUDE_DIR}")
      unset(_lce_blas_libs)
      unset(_lce_vendor)
    endif()
  endif()
endif()

if(TARGET lce::blas)
  set(LCE_BLAS_FOUND TRUE)
  if(NOT LCE_BLAS_FIND_QUIETLY)
    message(STATUS "lce: BLAS (LCE_BLAS=${_lce_blas_want}) via ${_lce_blas_how}")
  endif()
else()
  if(_lce_blas_want MATCHES "^(auto|openblas|generic)$")
    set(_lce_blas_fix "On Debian/Ubuntu install it with:  sudo apt-get install libopenblas-dev pkg-config  (or run scripts/install-deps.sh from the lce source tree). Elsewhere, point PKG_CONFIG_PATH at openblas.pc, or set BLA_VENDOR / CMAKE_PREFIX_PATH for FindBLAS.")
  elseif(_lce_blas_want STREQUAL "blis")
    set(_lce_blas_fix "On Debian/Ubuntu: sudo apt-get install libblis-dev. Elsewhere, point PKG_CONFIG_PATH at blis.pc or CMAKE_PREFIX_PATH at BLIS's prefix.")
  else()
    set(_lce_blas_fix "Install oneMKL (e.g. pip install mkl-devel) and point PKG_CONFIG_PATH at its lib/pkgconfig (mkl-dynamic-lp64-seq.pc), or set MKLROOT.")
  endif()
  string(CONCAT LCE_BLAS_NOT_FOUND_MESSAGE
    "lce needs a CBLAS (cblas.h and a library exporting cblas_sgemm/cblas_dgemm) and found none "
    "for LCE_BLAS=${_lce_blas_want}. ${_lce_blas_fix} "
    "Or choose another with -DLCE_BLAS=auto|openblas|blis|mkl|generic.")
  unset(_lce_blas_fix)
endif()
unset(_lce_blas_how)
unset(_lce_blas_want)
unset(_lce_blas_arch_dirs)
