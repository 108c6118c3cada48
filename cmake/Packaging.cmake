# install() rules and the CPack Debian package (deploy/PACKAGES.md).
#   cmake --install build --prefix /opt/moerun     the files below, under any prefix
#   (cd build && cpack -G DEB)                      ./moerun_<version>_<arch>.deb (prefix /usr)
# Installing never rebuilds the tree (CMAKE_SKIP_INSTALL_ALL_DEPENDENCY): it copies what is built,
# so build the targets first (cmake --build build --target moerun moectl moebench moerun_client).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
set(CMAKE_SKIP_INSTALL_ALL_DEPENDENCY ON)

# The three commands, copied as built and then stripped of their RUNPATH (they need only the
# system's libraries; ours are static). Not install(TARGETS): its RPATH_CHANGE insists on the
# build RPATH of the current build files, and fails on a binary linked before they last changed.
foreach(cmd moerun moectl moebench)
  install(PROGRAMS $<TARGET_FILE:${cmd}> DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(CODE "file(RPATH_REMOVE FILE \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}/${cmd}\")")
endforeach()

# The C++ client library: moerun::client (with moerun::proto, moerun::base and the interface target
# moerun::flags, which it links) and the headers of its public interface, under include/moerun
# (#include "runtime/serving/serve_client.h", as in the repository).
set_target_properties(moerun_proto PROPERTIES EXPORT_NAME proto)
set_target_properties(moerun_base PROPERTIES EXPORT_NAME base)
set_target_properties(moerun_flags PROPERTIES EXPORT_NAME flags)
set(moerun_include_dir ${CMAKE_INSTALL_INCLUDEDIR}/moerun)
install(TARGETS moerun_client moerun_proto moerun_base moerun_flags EXPORT moerunTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${moerun_include_dir})
install(FILES runtime/serving/serve_client.h runtime/serving/failover_client.h
  runtime/serving/infer_codec.h runtime/serving/batcher.h runtime/serving/frame.h
  runtime/serving/buffer_pool.h runtime/serving/host_port.h runtime/serving/tls_client.h
  DESTINATION ${moerun_include_dir}/runtime/serving)
install(FILES base/aligned_buffer.h base/clock.h base/dtype.h base/function_ref.h base/status.h
  DESTINATION ${moerun_include_dir}/base)
foreach(p ${MOERUN_PROTOS})
  get_filename_component(stem ${p} NAME_WE)
  get_filename_component(dir ${p} DIRECTORY)
  install(FILES ${PROJECT_BINARY_DIR}/generated/${dir}/${stem}.pb.h
    DESTINATION ${moerun_include_dir}/${dir})
  install(FILES runtime/proto/${p} DESTINATION ${CMAKE_INSTALL_DATADIR}/moerun/proto/${dir})
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/generated/moerun/build_info.h
  DESTINATION ${moerun_include_dir}/moerun)

set(moerun_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/moerun)
install(EXPORT moerunTargets NAMESPACE moerun:: DESTINATION ${moerun_cmake_dir})
configure_package_config_file(cmake/moerunConfig.cmake.in
  ${PROJECT_BINARY_DIR}/moerunConfig.cmake INSTALL_DESTINATION ${moerun_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/moerunConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/moerunConfig.cmake ${PROJECT_BINARY_DIR}/moerunConfigVersion.cmake
  DESTINATION ${moerun_cmake_dir})

# Configs, and the small model configs/tiny.yaml points at (../tests/data/hf-moe/deepseek_v3,
# from share/moerun/configs), with its golden input and output.
file(GLOB moerun_configs ${PROJECT_SOURCE_DIR}/configs/*.yaml)
install(FILES ${moerun_configs} DESTINATION ${CMAKE_INSTALL_DATADIR}/moerun/configs)
install(DIRECTORY tests/data/hf-moe/deepseek_v3
  DESTINATION ${CMAKE_INSTALL_DATADIR}/moerun/tests/data/hf-moe)

# The systemd unit of a single-host job, and the defaults of its /etc/moerun files (the package's
# postinst copies them there when they are missing; the unit reads /etc/moerun/moerun.env).
install(FILES deploy/systemd/moerun.service DESTINATION lib/systemd/system)
install(FILES deploy/systemd/moerun.env deploy/systemd/moerun.yaml
  DESTINATION ${CMAKE_INSTALL_DATADIR}/moerun/etc)

install(FILES README.md docs/DESIGN.md deploy/PACKAGES.md DESTINATION ${CMAKE_INSTALL_DOCDIR})

# The Debian package: one package, moerun, whose Depends dpkg-shlibdeps reads off the binaries.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME moerun)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR moerun)
set(CPACK_PACKAGE_CONTACT "moerun maintainers <moerun@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
  "Mixture-of-Experts layer runtime: moerun, moectl, moebench and the C++ client library")
set(CPACK_PACKAGE_DESCRIPTION
  "Serves Mixture-of-Experts layers across router and expert ranks (MPI, UCX or threads).")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "moerun maintainers <moerun@localhost>")
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # moerun_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
  ${PROJECT_SOURCE_DIR}/deploy/systemd/postinst ${PROJECT_SOURCE_DIR}/deploy/systemd/postrm)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
