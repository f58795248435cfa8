# A compile-fail check: SOURCE must NOT compile, and the compiler's output
# must contain every "// expect: <text>" line of SOURCE (literal text). The
# same file compiled with -DLCE_COMPILE_FAIL_CONTROL must compile, so that the
# failure is the one meant and not a typo.
#
#   cmake -DCXX=<compiler> -DSOURCE=<file.cpp> -DINCLUDES=<dir|dir...>
#         -DDEFINES=<def|def...> -P run_compile_fail.cmake
cmake_minimum_required(VERSION 3.25)

file(STRINGS "${SOURCE}" expect_lines REGEX "^// expect: ")
if(NOT expect_lines)
  message(FATAL_ERROR "${SOURCE}: no '// expect: ' line")
endif()

set(args -std=c++20 -fsyntax-only)
string(REPLACE "|" ";" includes "${INCLUDES}")
foreach(dir IN LISTS includes)
  if(dir)
    list(APPEND args "-I${dir}")
  endif()
endforeach()
string(REPLACE "|" ";" defines "${DEFINES}")
foreach(def IN LISTS defines)
  if(def)
    list(APPEND args "-D${def}")
  endif()
endforeach()

execute_process(COMMAND "${CXX}" ${args} -DLCE_COMPILE_FAIL_CONTROL "${SOURCE}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the control variant (-DLCE_COMPILE_FAIL_CONTROL) of ${SOURCE} does not compile:\n${out}")
endif()

execute_process(COMMAND "${CXX}" ${args} "${SOURCE}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but must not")
endif()
foreach(line IN LISTS expect_lines)
  string(REGEX REPLACE "^// expect: " "" expected "${line}")
  string(FIND "${out}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${SOURCE} failed to compile, but without the expected message\n  ${expected}\n"
                        "compiler output:\n${out}")
  endif()
  message(STATUS "refused as expected: ${expected}")
endforeach()
