# mt_add_plugin(<target> SOURCES <src>... [LIBS <lib>...])
#
# Declares an mt plugin: a shared object named lib<target>.so (call it mt_<kind>_<name>, e.g.
# mt_model_llama), built with hidden visibility against the SDK, placed where the loader finds
# it. Works in the mt source tree and out of tree after find_package(mt).
#
# Out of tree too, the build tree's RPATHs must not end in an empty entry (the current directory
# to the dynamic loader), which CMake's in-place install-time RPATH editing pads them with.
if(NOT DEFINED CMAKE_NO_BUILTIN_CHRPATH)
  set(CMAKE_NO_BUILTIN_CHRPATH ON)
endif()
function(mt_add_plugin target)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_library(${target} MODULE ${ARG_SOURCES})
  target_link_libraries(${target} PRIVATE mt::core ${ARG_LIBS})
  set_target_properties(${target} PROPERTIES
    PREFIX "lib"
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  set_property(GLOBAL APPEND PROPERTY MT_PLUGIN_TARGETS ${target})
  if(MT_PLUGIN_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${MT_PLUGIN_OUTPUT_DIR})
  endif()
  if(MT_INSTALL_PLUGIN_DIR)
    install(TARGETS ${target} LIBRARY DESTINATION ${MT_INSTALL_PLUGIN_DIR})
  endif()
endfunction()
