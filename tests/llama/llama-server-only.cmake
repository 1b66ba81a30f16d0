# Included after every project() call of the llama.cpp build (CMAKE_PROJECT_INCLUDE, set by
# llama-server.cmake). Once the whole tree is configured:
# * every target but llama-server leaves `all`; what llama-server links (ggml, llama, common,
#   mtmd, the server libraries) is still built, as its dependencies;
# * everything outside ggml/ is compiled at -O1 instead of -O3 (about a fifth less compile
#   time; the tests' tiny model spends its time in ggml's kernels, which keep -O3).
get_property(_sfq_hooked GLOBAL PROPERTY SFQ_LLAMA_SERVER_ONLY)
if(NOT _sfq_hooked)
    set_property(GLOBAL PROPERTY SFQ_LLAMA_SERVER_ONLY ON)

    function(_sfq_trim_targets dir)
        get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
        foreach(t IN LISTS targets)
            get_target_property(type ${t} TYPE)
            if(type STREQUAL "INTERFACE_LIBRARY")
                continue()
            endif()
            if(NOT t STREQUAL "llama-server")
                set_property(TARGET ${t} PROPERTY EXCLUDE_FROM_ALL ON)
            endif()
            get_target_property(src ${t} SOURCE_DIR)
            string(FIND "${src}/" "${CMAKE_SOURCE_DIR}/ggml/" in_ggml)
            if(NOT type STREQUAL "UTILITY" AND NOT in_ggml EQUAL 0)
                # target options come after CMAKE_<LANG>_FLAGS_RELEASE on the command line: -O1 wins
                set_property(TARGET ${t} APPEND PROPERTY COMPILE_OPTIONS -O1)
            endif()
        endforeach()
        get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
        foreach(sub IN LISTS subdirs)
            _sfq_trim_targets("${sub}")
        endforeach()
    endfunction()

    function(_sfq_llama_server_only)
        if(NOT TARGET llama-server)
            message(FATAL_ERROR "llama-server-only.cmake: this llama.cpp defines no llama-server target")
        endif()
        _sfq_trim_targets("${CMAKE_SOURCE_DIR}")
        message(STATUS "sfq: building llama-server only (-O1 outside ggml)")
    endfunction()

    cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _sfq_llama_server_only)
endif()
