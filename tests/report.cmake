# The shared benchmark report library (bench/report.h); included from tests/CMakeLists.txt.
dear_test(test_report SOURCES test_report.cc LIBS dear_bench_report LABELS unit)

# dear-bench end to end, on two or four ranks.
if(TARGET dear-bench AND TARGET dear-run)
  # Flags that validate() refuses: the job fails and the reason reaches the terminal whichever
  # rank exits first (dear-run stops the others then). Five runs, since which rank exits first
  # is up to the scheduler.
  add_test(NAME dear_bench_refused_flags
           COMMAND bash -c "for i in 1 2 3 4 5; do
               if out=$($<TARGET_FILE:dear-run> -n 4 $<TARGET_FILE:dear-bench> all_reduce -b 0 -e 1K 2>&1); then
                 echo \"run $i: the job succeeded\"; exit 1
               fi
               if ! grep -q 'dear-bench: rank [0-3]: .*--minbytes 0 with a step factor never grows' <<<\"$out\"; then
                 echo \"run $i: no rank said why:\"; echo \"$out\"; exit 1
               fi
             done")
  set_tests_properties(dear_bench_refused_flags PROPERTIES LABELS multiproc TIMEOUT 120)

  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    # --samples: two ranks, three sizes, both placements; check_samples.py recomputes rank 0's
    # p50/p99 from the samples and compares them with the run's --json.
    add_test(NAME dear_bench_samples
             COMMAND bash -c "set -euo pipefail
               dir=$(mktemp -d)
               trap 'rm -rf \"$dir\"' EXIT
               $<TARGET_FILE:dear-run> -n 2 $<TARGET_FILE:dear-bench> all_reduce -b 1K -e 4K -n 7 -w 1 --samples \"$dir/s.csv\" --json \"$dir/r.json\"
               ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/check_samples.py \"$dir/s.csv\" \"$dir/r.json\" 7")
    set_tests_properties(dear_bench_samples PROPERTIES LABELS multiproc TIMEOUT 120)
    # --placement: only the placement asked for is timed, checked and sampled; the other is
    # null in the JSON (check_samples.py with the row count and the placement).
    add_test(NAME dear_bench_placement
             COMMAND bash -c "set -euo pipefail
               dir=$(mktemp -d)
               trap 'rm -rf \"$dir\"' EXIT
               for p in oop:out ip:in; do
                 $<TARGET_FILE:dear-run> -n 2 $<TARGET_FILE:dear-bench> all_reduce -b 1K -e 4K -n 3 -w 1 --placement \${p#*:} --samples \"$dir/s.csv\" --json \"$dir/r.json\"
                 ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/check_samples.py \"$dir/s.csv\" \"$dir/r.json\" 3 3 \${p%:*}
               done")
    set_tests_properties(dear_bench_placement PROPERTIES LABELS multiproc TIMEOUT 120)
    # --fabric-provider and --ib-device: refused for another transport, and (where libfabric is
    # built) the provider named is the one that runs (dear_bench_transport_flags.sh).
    set(fabric "")
    if(DEAR_HAVE_FABRIC)
      set(fabric fabric)
    endif()
    add_test(NAME dear_bench_transport_flags
             COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/dear_bench_transport_flags.sh
                     $<TARGET_FILE:dear-run> $<TARGET_FILE:dear-bench> ${Python3_EXECUTABLE}
                     ${fabric})
    set_tests_properties(dear_bench_transport_flags PROPERTIES LABELS multiproc TIMEOUT 120
      SKIP_REGULAR_EXPRESSION "is not available here")
    add_test(NAME dear_bench_collectives
             COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/dear_bench_collectives.sh
                     $<TARGET_FILE:dear-run> $<TARGET_FILE:dear-bench>)
    set_tests_properties(dear_bench_collectives PROPERTIES LABELS multiproc TIMEOUT 180)
    # scripts/compare-peers.sh at its smallest: dear and Open MPI, 2 ranks, two rounds; the
    # merged table, the 8 B target line and its per-round ratios, which are recomputed from
    # each run's JSON (compare_peers_smoke.sh).
    find_program(DEAR_MPIRUN NAMES mpirun)
    if(TARGET mpi-bench AND TARGET dear-tcp-ring AND DEAR_MPIRUN)
      add_test(NAME compare_peers_smoke
               COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/compare_peers_smoke.sh ${PROJECT_BINARY_DIR})
      set_tests_properties(compare_peers_smoke PROPERTIES LABELS multiproc TIMEOUT 300)
    endif()
  endif()
endif()
