# Included right after llama.cpp's project() call while pip builds llama-cpp-python for the test server (the
# Makefile's LLAMA_CPP_CMAKE_ARGS name it as CMAKE_PROJECT_llama.cpp_INCLUDE). llama-cpp-python 0.3.36 forces
# LLAMA_BUILD_COMMON on, so no -D on the command line can turn it off, yet its Python code loads only libllama and
# libggml: the common library and the HTTP client it links (cpp-httplib) were 43 % of the build's compile time.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)
