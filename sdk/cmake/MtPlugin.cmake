# mt_add_plugin(<target> SOURCES <src>... [LIBS <lib>...])
#
# Declares an mt plugin: a shared object named lib<target>.so (call it mt_<kind>_<name>, e.g.
# mt_model_llama), built with hidden visibility against the SDK, placed where the loader finds
# it. Works in the mt source tree and out of tree after find_package(mt).
#
# A plugin is linked with its install RUNPATH (by default none: the process loading it has
# libmt_core already), never with a build RUNPATH, which CMake pads with an empty entry for
# in-place editing at install, and an empty entry makes the loader search the current directory.
function(mt_add_plugin target)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_library(${target} MODULE ${ARG_SOURCES})
  target_link_libraries(${target} PRIVATE mt::core ${ARG_LIBS})
  set_target_properties(${target} PROPERTIES
    PREFIX "lib"
    BUILD_WITH_INSTALL_RPATH ON
    INSTALL_RPATH ""
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
