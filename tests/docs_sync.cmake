# Checks that docs/API.md, the repository's own API reference, carries every
# line of code of the public contract it was written from (an API.md kept
# beside the checkout), so the reference cannot drift from the contract.
#   cmake -DSHARED_API=<contract API.md> -DDOCS_API=<docs/API.md> -P docs_sync.cmake
#
# The contract's code is every line of a fenced block (``` or ~~~) and of an
# indented block (4 spaces or a tab, after a blank line or more code). Each
# such line, stripped and not empty, must be a line of docs/API.md (stripped).
# Where the contract is not there (a plain clone), this says so and passes.
if(NOT DEFINED SHARED_API OR SHARED_API STREQUAL "" OR NOT EXISTS "${SHARED_API}")
  message(STATUS "docs_sync: no contract at '${SHARED_API}' (a clone without it): nothing to compare, passing")
  return()
endif()
if(NOT DEFINED DOCS_API OR NOT EXISTS "${DOCS_API}")
  message(FATAL_ERROR "docs_sync: DOCS_API = '${DOCS_API}' does not exist (docs/API.md is the API reference)")
endif()

# The text as a CMake list of lines. `;` and square brackets would split or
# group list elements, so they travel as placeholders and come back for messages.
function(lines_of file out)
  file(READ "${file}" text)
  string(REPLACE "\r" "" text "${text}")
  string(REPLACE ";" "<lce:semicolon>" text "${text}")
  string(REPLACE "[" "<lce:open>" text "${text}")
  string(REPLACE "]" "<lce:close>" text "${text}")
  string(REPLACE "\\" "<lce:backslash>" text "${text}")
  string(REPLACE "\n" ";" text "${text}")
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

function(readable line out)
  string(REPLACE "<lce:semicolon>" ";" line "${line}")
  string(REPLACE "<lce:open>" "[" line "${line}")
  string(REPLACE "<lce:close>" "]" line "${line}")
  string(REPLACE "<lce:backslash>" "\\" line "${line}")
  set(${out} "${line}" PARENT_SCOPE)
endfunction()

# The contract's code lines, stripped, in order.
lines_of("${SHARED_API}" contract)
set(code "")
set(fence "")            # the open fence (``` or ~~~), "" outside one
set(previous "blank")    # blank, code or text: what the last line was
foreach(line IN LISTS contract)
  string(STRIP "${line}" stripped)
  if(fence STREQUAL "")
    if(stripped MATCHES "^(```|~~~)")
      string(SUBSTRING "${stripped}" 0 3 fence)
      set(previous "text")
      continue()
    endif()
    if(stripped STREQUAL "")
      set(previous "blank")
    elseif(line MATCHES "^(    |\t)" AND NOT previous STREQUAL "text")
      list(APPEND code "${stripped}")
      set(previous "code")
    else()
      set(previous "text")
    endif()
  else()
    if(stripped MATCHES "^${fence}")
      set(fence "")
      set(previous "text")
    elseif(NOT stripped STREQUAL "")
      list(APPEND code "${stripped}")
    endif()
  endif()
endforeach()

list(LENGTH code count)
if(count EQUAL 0)
  message(FATAL_ERROR "docs_sync: found no code in ${SHARED_API}; is it the contract?")
endif()

# docs/API.md's lines, stripped.
lines_of("${DOCS_API}" docs)
set(reference "")
foreach(line IN LISTS docs)
  string(STRIP "${line}" stripped)
  if(NOT stripped STREQUAL "")
    list(APPEND reference "${stripped}")
  endif()
endforeach()

set(missing "")
set(missing_count 0)
foreach(line IN LISTS code)
  list(FIND reference "${line}" at)
  if(at EQUAL -1)
    readable("${line}" shown)
    string(APPEND missing "\n  ${shown}")
    math(EXPR missing_count "${missing_count} + 1")
  endif()
endforeach()

if(missing_count GREATER 0)
  message(FATAL_ERROR "docs_sync: ${missing_count} of the ${count} code lines of ${SHARED_API} are not lines of "
                      "${DOCS_API} (copy them verbatim into its code blocks):${missing}")
endif()
message(STATUS "docs_sync: all ${count} code lines of ${SHARED_API} are in ${DOCS_API}")
