# Libraries every build needs (Debian 12 packages; see scripts/install-deps.sh).
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(spdlog REQUIRED)
find_package(fmt REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(Protobuf 3.12 REQUIRED)
find_package(Boost 1.74 REQUIRED)  # Asio and Beast (header-only)
find_package(OpenSSL 1.1.1 REQUIRED)  # TLS on the serving and control endpoints
find_package(CLI11 CONFIG QUIET)
if(NOT CLI11_FOUND)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE ${CLI11_INCLUDE_DIR})
endif()

# OpenBLAS: only the sgemm baseline of moebench uses it (never the layer itself: BLAS libraries do
# not promise batch-invariant results).
find_path(OPENBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas-pthread openblas
          PATHS /usr/include/x86_64-linux-gnu /usr/include/aarch64-linux-gnu)
find_library(OPENBLAS_LIBRARY NAMES openblas PATH_SUFFIXES openblas-pthread
             PATHS /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu)
if(OPENBLAS_INCLUDE_DIR AND OPENBLAS_LIBRARY)
  set(MOERUN_HAVE_OPENBLAS 1)
  add_library(moerun_openblas INTERFACE)
  target_include_directories(moerun_openblas INTERFACE ${OPENBLAS_INCLUDE_DIR})
  target_link_libraries(moerun_openblas INTERFACE ${OPENBLAS_LIBRARY})
else()
  set(MOERUN_HAVE_OPENBLAS 0)
  message(WARNING "OpenBLAS not found: moebench will run without its sgemm baseline")
endif()
