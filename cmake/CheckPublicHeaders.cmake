# CTest's public_headers test: compiles each installed header of the C++ API
# (include/torch_sac/*.h) alone, and fails when one does not compile by
# itself or pulls in a header of the region engine (csrc/core/region/): the
# public headers expose the API only, not the engine's private fields.
#
#   cmake -DCXX=... -DSOURCE_DIR=... -DINCLUDE_DIRS="a|b" -P CheckPublicHeaders.cmake
string(REPLACE "|" ";" INCLUDE_DIRS "${INCLUDE_DIRS}")
file(GLOB headers "${SOURCE_DIR}/include/torch_sac/*.h")
set(flags -std=c++20 -fsyntax-only -H -x c++)
foreach(dir IN LISTS INCLUDE_DIRS)
  list(APPEND flags "-I${dir}")
endforeach()
set(failed "")
foreach(header IN LISTS headers)
  get_filename_component(name "${header}" NAME)
  execute_process(
    COMMAND "${CXX}" ${flags} "${header}"
    RESULT_VARIABLE result
    OUTPUT_VARIABLE out
    ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message("${name}: does not compile alone:\n${err}")
    list(APPEND failed "${name}")
    continue()
  endif()
  # -H lists every header included, one per line, indented by depth.
  string(REGEX MATCHALL "[^\n]*csrc/core/region/[^\n]*" private "${err}")
  if(private)
    string(REPLACE ";" "\n" private "${private}")
    message("${name}: includes headers of the region engine:\n${private}")
    list(APPEND failed "${name}")
  endif()
endforeach()
if(failed)
  message(FATAL_ERROR "public headers failing the check: ${failed}")
endif()
list(LENGTH headers count)
message(STATUS "${count} public headers compile alone and include no csrc/core/region/ header")
