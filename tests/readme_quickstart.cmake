# Checks that a README snippet is the code of an example between its two
# `// [NAME]` markers, so the README cannot rot (NAME: quickstart by default).
#   cmake -DREADME=<README.md> -DEXAMPLE=<source> [-DNAME=<marker>] -P readme_quickstart.cmake
# The README holds it as a ```cpp block between <!-- NAME:begin --> and <!-- NAME:end -->.
if(NOT DEFINED NAME OR NAME STREQUAL "")
  set(NAME quickstart)
endif()
file(READ "${EXAMPLE}" example)
string(REGEX MATCH "// \\[${NAME}\\][^\n]*\n(.*)\n[ ]*// \\[${NAME}\\]" found "${example}")
if(NOT found)
  message(FATAL_ERROR "${EXAMPLE}: no region between two `// [${NAME}]` markers")
endif()
set(from_example "${CMAKE_MATCH_1}")

file(READ "${README}" readme)
string(REGEX MATCH "<!-- ${NAME}:begin -->\n```cpp\n(.*)\n```\n<!-- ${NAME}:end -->" found "${readme}")
if(NOT found)
  message(FATAL_ERROR "${README}: no ```cpp block between <!-- ${NAME}:begin --> and <!-- ${NAME}:end -->")
endif()
set(from_readme "${CMAKE_MATCH_1}")

if(NOT from_example STREQUAL from_readme)
  file(WRITE "${CMAKE_BINARY_DIR}/${NAME}_from_example.txt" "${from_example}")
  message(FATAL_ERROR "README ${NAME} differs from ${EXAMPLE}; the example's region is in "
                      "${CMAKE_BINARY_DIR}/${NAME}_from_example.txt")
endif()
message(STATUS "README ${NAME} matches ${EXAMPLE}")
