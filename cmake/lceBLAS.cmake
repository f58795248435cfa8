# lceBLAS.cmake — find a CBLAS for lce's host backend and expose it as the
# imported INTERFACE target `lce::blas` (include dirs + libraries).
#
# Used twice: by lce's own CMakeLists.txt, and (installed next to
# lceConfig.cmake) by the package config, so consumers re-find the BLAS on
# their machine instead of inheriting paths from the machine lce was built on.
#
# Order of preference:
#   1. pkg-config module `openblas` (Debian: libopenblas-dev)
#   2. find_package(BLAS) + find_path(cblas.h)
#
# Result: target lce::blas, and LCE_BLAS_FOUND (TRUE/FALSE). On failure
# LCE_BLAS_NOT_FOUND_MESSAGE holds a message for the caller to report; this file
# never raises a FATAL_ERROR itself, so find_package(lce QUIET) stays quiet.

if(TARGET lce::blas)
  set(LCE_BLAS_FOUND TRUE)
  return()
endif()

set(LCE_BLAS_FOUND FALSE)
set(_lce_blas_how "")

# --- 1. pkg-config: openblas -------------------------------------------------
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(LCE_OPENBLAS QUIET IMPORTED_TARGET openblas)
  if(LCE_OPENBLAS_FOUND AND TARGET PkgConfig::LCE_OPENBLAS)
    # Debian's openblas.pc puts cblas.h on the include path; check anyway.
    find_path(LCE_CBLAS_INCLUDE_DIR cblas.h
      HINTS ${LCE_OPENBLAS_INCLUDE_DIRS}
      NO_DEFAULT_PATH)
    if(LCE_CBLAS_INCLUDE_DIR)
      add_library(lce::blas INTERFACE IMPORTED)
      set_target_properties(lce::blas PROPERTIES
        INTERFACE_LINK_LIBRARIES PkgConfig::LCE_OPENBLAS)
      set(_lce_blas_how "pkg-config openblas ${LCE_OPENBLAS_VERSION}")
    else()
      unset(LCE_CBLAS_INCLUDE_DIR CACHE)
    endif()
  endif()
endif()

# --- 2. FindBLAS + cblas.h ---------------------------------------------------
if(NOT TARGET lce::blas)
  find_package(BLAS QUIET)
  if(BLAS_FOUND)
    find_path(LCE_CBLAS_INCLUDE_DIR cblas.h
      PATH_SUFFIXES
        openblas
        x86_64-linux-gnu/openblas-pthread x86_64-linux-gnu/openblas-openmp
        x86_64-linux-gnu/openblas-serial
        aarch64-linux-gnu/openblas-pthread aarch64-linux-gnu/openblas-openmp
        x86_64-linux-gnu aarch64-linux-gnu
        cblas)
    if(LCE_CBLAS_INCLUDE_DIR)
      add_library(lce::blas INTERFACE IMPORTED)
      set_target_properties(lce::blas PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "${LCE_CBLAS_INCLUDE_DIR}")
      if(TARGET BLAS::BLAS)
        set_property(TARGET lce::blas PROPERTY INTERFACE_LINK_LIBRARIES BLAS::BLAS)
      else()
        set_property(TARGET lce::blas PROPERTY INTERFACE_LINK_LIBRARIES
          ${BLAS_LIBRARIES} ${BLAS_LINKER_FLAGS})
      endif()
      set(_lce_blas_how "FindBLAS (${BLAS_LIBRARIES}), cblas.h in ${LCE_CBLAS_INCLUDE_DIR}")
    endif()
  endif()
endif()

if(TARGET lce::blas)
  set(LCE_BLAS_FOUND TRUE)
  if(NOT LCE_BLAS_FIND_QUIETLY)
    message(STATUS "lce: BLAS via ${_lce_blas_how}")
  endif()
else()
  string(CONCAT LCE_BLAS_NOT_FOUND_MESSAGE
    "lce needs a CBLAS (cblas.h and a library exporting cblas_sgemm/cblas_dgemm) "
    "and found none (tried pkg-config module 'openblas', then FindBLAS + cblas.h). "
    "On Debian/Ubuntu install it with:  sudo apt-get install libopenblas-dev pkg-config  "
    "(or run scripts/install-deps.sh from the lce source tree). Elsewhere, point "
    "PKG_CONFIG_PATH at openblas.pc, or set BLA_VENDOR / CMAKE_PREFIX_PATH for FindBLAS.")
endif()
unset(_lce_blas_how)
