# Build and run tests/consumer/project in a fresh folder.
#
#   cmake -DLCE_CONSUME=find_package|add_subdirectory|fetchcontent
#         -DLCE_SOURCE_DIR=<lce source> -DWORK_DIR=<scratch folder>
#         [-DGENERATOR=<cmake generator>] [-DCXX_COMPILER=<c++ compiler>]
#         -P run_consumer.cmake
#
# find_package: configure lce alone (tests/examples/bench OFF) in WORK_DIR/lce-build,
# install it to WORK_DIR/install, then build the consumer against that prefix.
# add_subdirectory / fetchcontent: build the consumer straight from LCE_SOURCE_DIR.
cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS LCE_CONSUME LCE_SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT LCE_CONSUME MATCHES "^(find_package|add_subdirectory|fetchcontent)$")
  message(FATAL_ERROR "run_consumer.cmake: unknown LCE_CONSUME '${LCE_CONSUME}'")
endif()

set(project_dir "${CMAKE_CURRENT_LIST_DIR}/project")
set(build_dir "${WORK_DIR}/build")
set(common_args)
if(DEFINED GENERATOR AND NOT GENERATOR STREQUAL "")
  list(APPEND common_args -G "${GENERATOR}")
endif()
if(DEFINED CXX_COMPILER AND NOT CXX_COMPILER STREQUAL "")
  list(APPEND common_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
# Never pick up an lce registered or installed elsewhere on this machine.
list(APPEND common_args
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)

function(step what)
  string(REPLACE ";" " " pretty "${ARGN}")
  message(STATUS "[consumer ${LCE_CONSUME}] ${what}: ${pretty}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "[consumer ${LCE_CONSUME}] ${what} failed (${rc})")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(consumer_args -DLCE_CONSUME=${LCE_CONSUME})
if(LCE_CONSUME STREQUAL "find_package")
  set(prefix "${WORK_DIR}/install")
  step("configure lce" "${CMAKE_COMMAND}" ${common_args}
       -S "${LCE_SOURCE_DIR}" -B "${WORK_DIR}/lce-build"
       -DLCE_BUILD_TESTS=OFF -DLCE_BUILD_EXAMPLES=OFF -DLCE_BUILD_BENCH=OFF
       "-DCMAKE_INSTALL_PREFIX=${prefix}")
  step("build lce" "${CMAKE_COMMAND}" --build "${WORK_DIR}/lce-build")
  step("install lce" "${CMAKE_COMMAND}" --install "${WORK_DIR}/lce-build" --prefix "${prefix}")
  foreach(f IN ITEMS include/lce/lce.hpp)
    if(NOT EXISTS "${prefix}/${f}")
      message(FATAL_ERROR "[consumer find_package] install is missing ${f}")
    endif()
  endforeach()
  # The installed package must not point back into the source or build tree.
  file(GLOB_RECURSE cmake_files "${prefix}/*.cmake")
  foreach(f IN LISTS cmake_files)
    file(READ "${f}" text)
    foreach(tree IN ITEMS "${LCE_SOURCE_DIR}/include" "${WORK_DIR}/lce-build")
      string(FIND "${text}" "${tree}" at)
      if(NOT at EQUAL -1)
        message(FATAL_ERROR "[consumer find_package] ${f} refers to ${tree}")
      endif()
    endforeach()
  endforeach()
  list(APPEND consumer_args "-DCMAKE_PREFIX_PATH=${prefix}" "-DLCE_EXPECTED_PREFIX=${prefix}")
else()
  list(APPEND consumer_args "-DLCE_SOURCE_DIR=${LCE_SOURCE_DIR}")
endif()

step("configure consumer" "${CMAKE_COMMAND}" ${common_args} -S "${project_dir}" -B "${build_dir}" ${consumer_args})
step("build consumer" "${CMAKE_COMMAND}" --build "${build_dir}")
step("run consumer" "${build_dir}/lce_consumer")
message(STATUS "[consumer ${LCE_CONSUME}] PASS")
