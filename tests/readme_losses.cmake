# Checks that each loss snippet of the README (the ```cpp block between
# <!-- loss:NAME:begin --> and <!-- loss:NAME:end -->) is the code of
# examples/losses.cpp between its two `// [loss:NAME]` markers, for every NAME
# below, so the README's loss documentation cannot rot (the example is built
# and run, its results checked against plain loops, by the test example.losses).
#   cmake -DREADME=<README.md> -DEXAMPLE=<losses.cpp> -P readme_losses.cmake
file(READ "${EXAMPLE}" example)
file(READ "${README}" readme)
set(failed "")
foreach(name IN ITEMS packed sft pg dpo distill)
  string(REGEX MATCH "// \\[loss:${name}\\][^\n]*\n(.*)\n[ ]*// \\[loss:${name}\\]" found "${example}")
  if(NOT found)
    message(SEND_ERROR "${EXAMPLE}: no region between two `// [loss:${name}]` markers")
    continue()
  endif()
  set(from_example "${CMAKE_MATCH_1}")
  string(REGEX MATCH "<!-- loss:${name}:begin -->\n```cpp\n(.*)\n```\n<!-- loss:${name}:end -->" found "${readme}")
  if(NOT found)
    message(SEND_ERROR "${README}: no ```cpp block between <!-- loss:${name}:begin --> and <!-- loss:${name}:end -->")
    continue()
  endif()
  set(from_readme "${CMAKE_MATCH_1}")
  if(NOT from_example STREQUAL from_readme)
    file(WRITE "${CMAKE_BINARY_DIR}/loss_${name}_from_example.txt" "${from_example}")
    message(SEND_ERROR "README loss snippet '${name}' differs from ${EXAMPLE}; the example's region is in "
                       "${CMAKE_BINARY_DIR}/loss_${name}_from_example.txt")
    continue()
  endif()
  message(STATUS "README loss snippet '${name}' matches ${EXAMPLE}")
endforeach()
