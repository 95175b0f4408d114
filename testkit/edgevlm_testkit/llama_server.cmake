# Adds llama.cpp's llama-server to the CMake build that makes the llama-cpp-python wheel, so ggml (and its
# Vulkan or CUDA backend) is compiled once for both: a ratio against that server then measures the runtime
# around the very same kernels. Given to the wheel's build as
#
#     CMAKE_ARGS="... -DCMAKE_PROJECT_llama_cpp_INCLUDE=<this file>" \
#         pip wheel --config-settings=build-dir=DIR ...        # then DIR/bin/llama-server
#
# llama-cpp-python's CMakeLists adds tools/mtmd itself, so LLAMA_BUILD_TOOLS=ON would define mtmd twice; this
# file, included right after its project() call, adds only tools/ui and tools/server (their links to llama-common,
# mtmd and cpp-httplib, defined later by the same build, resolve when CMake generates). The wheel's contents do not change: llama-server's install rule
# points outside the wheel, and the binary stays in DIR/bin with its libraries (run it with that folder, or
# the folder it was copied to, on LD_LIBRARY_PATH).
function(_edgevlm_add_llama_server)
  set(llama_src ${CMAKE_SOURCE_DIR}/vendor/llama.cpp)
  # the server's and the UI's CMakeLists expect llama.cpp's project scope
  set(PROJECT_SOURCE_DIR ${llama_src})
  set(LLAMA_BUILD_SERVER ON)
  set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
  set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
  set(CMAKE_INSTALL_BINDIR ${CMAKE_BINARY_DIR}/not-in-wheel)  # absolute: outside the wheel's tree
  add_subdirectory(${llama_src}/tools/ui ${CMAKE_BINARY_DIR}/tools/ui)
  add_subdirectory(${llama_src}/tools/server ${CMAKE_BINARY_DIR}/tools/server)
  message(STATUS "edgevlm: llama-server added to this build (${CMAKE_BINARY_DIR}/bin/llama-server)")
endfunction()

_edgevlm_add_llama_server()
