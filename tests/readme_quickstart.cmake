# Checks that the README's quickstart is the code of examples/quickstart.cpp
# between its two `// [quickstart]` markers, so the README cannot rot.
#   cmake -DREADME=<README.md> -DEXAMPLE=<quickstart.cpp> -P readme_quickstart.cmake
file(READ "${EXAMPLE}" example)
string(REGEX MATCH "// \\[quickstart\\][^\n]*\n(.*)\n[ ]*// \\[quickstart\\]" found "${example}")
if(NOT found)
  message(FATAL_ERROR "${EXAMPLE}: no region between two `// [quickstart]` markers")
endif()
set(from_example "${CMAKE_MATCH_1}")

file(READ "${README}" readme)
string(REGEX MATCH "<!-- quickstart:begin -->\n```cpp\n(.*)\n```\n<!-- quickstart:end -->" found "${readme}")
if(NOT found)
  message(FATAL_ERROR "${README}: no ```cpp block between <!-- quickstart:begin --> and <!-- quickstart:end -->")
endif()
set(from_readme "${CMAKE_MATCH_1}")

if(NOT from_example STREQUAL from_readme)
  file(WRITE "${CMAKE_BINARY_DIR}/quickstart_from_example.txt" "${from_example}")
  message(FATAL_ERROR "README quickstart differs from ${EXAMPLE}; the example's region is in "
                      "${CMAKE_BINARY_DIR}/quickstart_from_example.txt")
endif()
message(STATUS "README quickstart matches ${EXAMPLE}")
