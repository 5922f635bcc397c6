# The scheduler layer's tests (fusion planners, policies, simulator); included from
# tests/CMakeLists.txt.
dear_test(test_scheduler SOURCES test_scheduler.cc LIBS dear_scheduler nlohmann_json::nlohmann_json
          LABELS unit)
# The fusion-threshold tuner (Bayesian optimisation) on synthetic objectives and the simulator.
dear_test(test_tuner SOURCES test_tuner.cc LIBS dear_scheduler LABELS unit)
target_compile_definitions(test_tuner PRIVATE DEAR_PROFILES_DIR="${PROJECT_SOURCE_DIR}/profiles")
# Profile replay on real collectives (ranks as threads over loopback).
dear_test(test_replay SOURCES test_replay.cc LIBS dear_scheduler dear_collectives LABELS unit
          PROPERTIES TIMEOUT 300)

# The policies on MPI (scheduler/mpi_comm.h): the MPI communicator against the reference and
# profile replay on it, under mpirun with 2, 3 and 4 ranks over loopback TCP.
# Not in sanitizer builds: LeakSanitizer reports Open MPI's own allocations at exit.
find_program(DEAR_MPIRUN NAMES mpirun)
if(DEAR_HAVE_MPI AND DEAR_MPIRUN AND NOT DEAR_SANITIZE)
  add_executable(test_mpi_comm test_mpi_comm.cc)
  target_link_libraries(test_mpi_comm PRIVATE dear_scheduler GTest::gtest dear_warnings)
  foreach(n IN ITEMS 2 3 4)
    add_test(NAME mpi.communicator_${n}ranks
             COMMAND ${DEAR_MPIRUN} --oversubscribe -np ${n} --mca pml ob1 --mca btl tcp,self
                     --mca btl_tcp_if_include lo $<TARGET_FILE:test_mpi_comm>)
    # Open MPI refuses to run as root unless told; CI runs as root.
    set_tests_properties(mpi.communicator_${n}ranks PROPERTIES LABELS multiproc TIMEOUT 300
                         ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
  endforeach()
endif()

# The policies on NCCL (scheduler/nccl_comm.h): its no-device error here; collectives and
# replay on a machine with CUDA devices (one rank per device).
if(DEAR_HAVE_NCCL AND TARGET dear_cuda)
  dear_test(test_nccl_comm SOURCES test_nccl_comm.cc LIBS dear_scheduler dear_cuda LABELS cuda
            PROPERTIES TIMEOUT 300)
endif()

# scripts/paper-table.sh at its smallest: one model, one network, 8 workers, every policy.
add_test(NAME paper_table_smoke
         COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/paper-table.sh --build ${PROJECT_BINARY_DIR}
                 --models resnet50 --nets 10gbe --workers 8)
set_tests_properties(paper_table_smoke PROPERTIES LABELS unit TIMEOUT 120
  PASS_REGULAR_EXPRESSION "\\| resnet50 \\| [0-9.]+ \\| [0-9]+ \\([0-9]+%\\) \\|.*x \\(dear_[a-z]+\\) \\|")

# dear-sim --json counts each policy's collectives per iteration: without fusion DeAR runs a
# reduce-scatter and an all-gather per layer, WFBP an all-reduce per parameter tensor (both
# counted here from the profile itself).
add_test(NAME dear_sim_ops_per_iteration
         COMMAND bash -c "set -euo pipefail
           p=${PROJECT_SOURCE_DIR}/profiles/resnet50.json
           out=$($<TARGET_FILE:dear-sim> --model \"$p\" --workers 4 --policies dear_notf,wfbp --json)
           layers=$(jq '.layers | length' \"$p\")
           tensors=$(jq '[.layers[].params | length] | add' \"$p\")
           notf=$(jq '.policies.dear_notf.ops_per_iteration' <<<\"$out\")
           wfbp=$(jq '.policies.wfbp.ops_per_iteration' <<<\"$out\")
           echo \"layers $layers tensors $tensors dear_notf $notf wfbp $wfbp\"
           [ \"$notf\" -eq $((2 * layers)) ] && [ \"$wfbp\" -eq \"$tensors\" ]")
set_tests_properties(dear_sim_ops_per_iteration PROPERTIES LABELS unit TIMEOUT 60)
