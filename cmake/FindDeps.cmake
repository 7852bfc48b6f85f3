# Finds the system libraries by header + library name (no pkg-config needed:
# the GPU machine has none, and unpacked .debs are found through
# CMAKE_PREFIX_PATH). Each becomes an imported target dep::NAME.
function(df_find_dep name header lib)
  find_path(${name}_INCLUDE_DIR ${header})
  find_library(${name}_LIBRARY NAMES ${lib})
  if(NOT ${name}_INCLUDE_DIR OR NOT ${name}_LIBRARY)
    message(FATAL_ERROR "dflash needs ${name} (${header}, lib${lib}); "
      "install it with scripts/install-deps.sh (Debian package ${ARGN})")
  endif()
  add_library(dep::${name} UNKNOWN IMPORTED GLOBAL)
  set_target_properties(dep::${name} PROPERTIES IMPORTED_LOCATION ${${name}_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${${name}_INCLUDE_DIR})
  message(STATUS "${name}: ${${name}_LIBRARY}")
endfunction()

df_find_dep(uring liburing.h uring liburing-dev)
df_find_dep(lz4 lz4.h lz4 liblz4-dev)
df_find_dep(zstd zstd.h zstd libzstd-dev)
df_find_dep(cjson cjson/cJSON.h cjson libcjson-dev)
