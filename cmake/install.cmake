# The installed library (docs/architecture.md, "The installed tree"): `cmake --install` puts
#   lib/libdear.so.0.1 (SONAME libdear.so.0.1)  the layers' archives linked whole
#   lib/libdear.a                               the same, where DEAR_INSTALL_STATIC=ON
#   include/dear/...                            the public headers and the generated version.h
#   lib/cmake/dear/dearConfig*.cmake            find_package(dear): dear::dear (dear::dear_static)
#   lib/pkgconfig/dear.pc                       pkg-config --cflags --libs dear (--static)
#   bin/dear-run, dear-sim, dear-train          the tools
# and `cpack -G DEB` packages that tree. Included from the top CMakeLists.txt after the layers.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

option(DEAR_INSTALL_STATIC "Also build and install libdear.a (dear::dear_static)" OFF)

foreach(backend CUDA FABRIC VERBS)
  if(DEAR_HAVE_${backend})
    set(DEAR_BUILT_WITH_${backend} 1)
  else()
    set(DEAR_BUILT_WITH_${backend} 0)
  endif()
endforeach()
configure_file(${PROJECT_SOURCE_DIR}/cmake/version.h.in ${PROJECT_BINARY_DIR}/include/dear/version.h
               @ONLY)
target_include_directories(dear_common PUBLIC $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>)

# The layers the library is made of, lowest first.
set(dear_layers dear_common dear_transport dear_reduce)
if(DEAR_HAVE_CUDA)
  list(APPEND dear_layers dear_cuda)
endif()
list(APPEND dear_layers dear_collectives dear_scheduler)

# The layers' objects make the library; linking the layers themselves as well brings what they
# link (OpenSSL, libfabric, ...) and adds nothing else, since their objects define every symbol.
set(dear_objects "")
foreach(layer ${dear_layers})
  list(APPEND dear_objects $<TARGET_OBJECTS:${layer}>)
endforeach()
add_library(dear SHARED ${PROJECT_SOURCE_DIR}/cmake/library_version.cc ${dear_objects})
add_library(dear::dear ALIAS dear)
target_link_libraries(dear PRIVATE ${dear_layers} dear_warnings INTERFACE Threads::Threads)
target_include_directories(dear PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_BINARY_DIR}/include
                           INTERFACE $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_compile_features(dear INTERFACE cxx_std_20)
set_target_properties(dear PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION
                      ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR}
                      INSTALL_RPATH_USE_LINK_PATH ON EXPORT_NAME dear)

install(TARGETS dear EXPORT dearTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/dear ${PROJECT_BINARY_DIR}/include/dear
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")

# What a static link needs besides libdear.a: the libraries the layers link, as linker flags
# (for dear.pc's Libs.private and dear::dear_static); a library outside the linker's own
# directories (the CUDA toolkit's, Open MPI's) also gets its directory as a run path.
set(dear_static_libs "")
macro(dear_static_add)
  foreach(lib ${ARGN})
    if(lib MATCHES "^-")
      list(APPEND dear_static_libs ${lib})
    elseif(lib MATCHES "/lib([^/]+)\\.(so|a)[0-9.]*$")
      set(name ${CMAKE_MATCH_1})
      get_filename_component(libdir ${lib} DIRECTORY)
      if(NOT libdir IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES)
        list(APPEND dear_static_libs -L${libdir} -Wl,-rpath,${libdir})
      endif()
      list(APPEND dear_static_libs -l${name})
    endif()
  endforeach()
endmacro()
dear_static_add(${OPENSSL_CRYPTO_LIBRARY})
if(DEAR_HAVE_FABRIC)
  dear_static_add(-lfabric)
endif()
if(DEAR_HAVE_VERBS)
  dear_static_add(-libverbs)
endif()
if(DEAR_HAVE_CUDA)
  dear_static_add(${CUDA_cudart_LIBRARY})
endif()
if(DEAR_HAVE_NCCL)
  dear_static_add(${DEAR_NCCL_LIBRARY})
endif()
if(DEAR_HAVE_MPI)
  dear_static_add(${MPI_mpi_LIBRARY})
endif()
list(APPEND dear_static_libs -lpthread)
list(REMOVE_DUPLICATES dear_static_libs)
list(JOIN dear_static_libs " " DEAR_LIBS_PRIVATE)

if(DEAR_INSTALL_STATIC)
  # One archive from the layers' archives (ar's MRI script), so a static user names one library.
  set(mri ${PROJECT_BINARY_DIR}/libdear.mri)
  set(mri_text "create ${PROJECT_BINARY_DIR}/libdear.a\n")
  foreach(layer ${dear_layers})
    string(APPEND mri_text "addlib $<TARGET_FILE:${layer}>\n")
  endforeach()
  string(APPEND mri_text "addmod $<TARGET_OBJECTS:dear>\nsave\nend\n")
  file(GENERATE OUTPUT ${mri} CONTENT "${mri_text}")
  add_custom_command(OUTPUT ${PROJECT_BINARY_DIR}/libdear.a
                     COMMAND ${CMAKE_COMMAND} -E rm -f ${PROJECT_BINARY_DIR}/libdear.a
                     COMMAND ${CMAKE_AR} -M < ${mri}
                     DEPENDS ${dear_layers} dear ${mri}
                     COMMENT "libdear.a from the layers' archives")
  add_custom_target(dear_static_archive ALL DEPENDS ${PROJECT_BINARY_DIR}/libdear.a)
  install(FILES ${PROJECT_BINARY_DIR}/libdear.a DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()

set(DEAR_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/dear)
install(EXPORT dearTargets NAMESPACE dear:: DESTINATION ${DEAR_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dearConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/dearConfig.cmake
                              INSTALL_DESTINATION ${DEAR_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dearConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dearConfig.cmake ${PROJECT_BINARY_DIR}/dearConfigVersion.cmake
        DESTINATION ${DEAR_CMAKE_DIR})

string(REGEX REPLACE "[^/]+" ".." DEAR_PC_UP ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
configure_file(${PROJECT_SOURCE_DIR}/cmake/dear.pc.in ${PROJECT_BINARY_DIR}/dear.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/dear.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# cpack -G DEB: the installed tree as one package. Its dependencies are the Debian packages of
# the libraries this build linked; the CUDA runtime and NCCL come with the CUDA toolkit, which
# is not a Debian package, so a build with CUDA says so in its description instead.
set(CPACK_PACKAGE_NAME dear)
set(CPACK_PACKAGE_VENDOR "the dear project")
set(CPACK_PACKAGE_CONTACT "dear developers <dear@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "Collective communication for data-parallel deep learning (DeAR's decoupled all-reduce)")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libs)
set(dear_deb_depends "libc6" "libstdc++6" "libssl3")
if(DEAR_HAVE_FABRIC)
  list(APPEND dear_deb_depends "libfabric1")
endif()
if(DEAR_HAVE_VERBS)
  list(APPEND dear_deb_depends "libibverbs1")
endif()
if(DEAR_HAVE_MPI)
  list(APPEND dear_deb_depends "libopenmpi3")
endif()
list(JOIN dear_deb_depends ", " CPACK_DEBIAN_PACKAGE_DEPENDS)
if(DEAR_HAVE_CUDA)
  set(CPACK_PACKAGE_DESCRIPTION
      "Built with CUDA: needs the CUDA ${CUDAToolkit_VERSION_MAJOR} runtime (and NCCL) of the toolkit.")
endif()
set(CPACK_GENERATOR DEB)
include(CPack)
