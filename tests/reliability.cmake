# Reliability and security (issue 8): the handshakes under attack, the soak, and the fuzz
# harnesses. Included from tests/CMakeLists.txt, after dear_test() is defined.

dear_test(test_bootstrap SOURCES test_bootstrap.cc LIBS dear_collectives LABELS unit
          PROPERTIES TIMEOUT 120)
# The short soak (1,500 operations); scripts/soak.sh runs the full one. These suites and the
# faults below are the longest (tens of seconds, over a minute under the sanitizers): a COST
# makes a parallel ctest start them first instead of last, where they ran on one core alone
# while the other idled (a fresh build has no timings of its own to order by).
dear_test(test_soak SOURCES test_soak.cc LIBS dear_collectives LABELS unit
          PROPERTIES TIMEOUT 300 COST 500)

# libFuzzer harnesses (clang only); scripts/fuzz.sh configures a separate build with this on.
option(DEAR_FUZZ "Build the libFuzzer harnesses in tests/fuzz (needs clang)" OFF)
if(DEAR_FUZZ)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/fuzz ${CMAKE_CURRENT_BINARY_DIR}/fuzz)
endif()

# Ranks as processes killed at random points and stalled (SIGSTOP / SIGCONT).
dear_test(test_faults SOURCES test_faults.cc LIBS dear_transport LABELS multiproc
          PROPERTIES TIMEOUT 600 COST 1000)
if(TARGET test_faults)
  target_compile_definitions(test_faults PRIVATE DEAR_WORKER_PATH="$<TARGET_FILE:dear-test-worker>")
  add_dependencies(test_faults dear-test-worker)
endif()
# The same over the shared-memory transport: a dead rank's rings stop, and its control sockets
# close.
dear_test(test_faults_shm SOURCES test_faults.cc LIBS dear_transport PREFIX "shm." LABELS multiproc
          PROPERTIES TIMEOUT 600 COST 1000)
if(TARGET test_faults_shm)
  target_compile_definitions(test_faults_shm PRIVATE DEAR_TEST_FAULTS_TRANSPORT="shm"
                             DEAR_WORKER_PATH="$<TARGET_FILE:dear-test-worker>")
  add_dependencies(test_faults_shm dear-test-worker)
endif()
