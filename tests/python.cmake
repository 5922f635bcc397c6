# The Python package's tests (label `python`); tests/CMakeLists.txt include()s this file.
# Each test runs its script on N ranks under dear-run with DEAR_TORCH_PYTHON (see
# python/CMakeLists.txt). A script exits 77 when that Python has no torch, and CTest reports the
# test as skipped rather than passed.
if(NOT TARGET dear_python OR NOT TARGET dear-run)
  message(STATUS "dear: Python tests skipped (the dear package or dear-run is not built)")
  return()
endif()

# dear_python_test(NAME SCRIPT RANKS [ARGS ...])
function(dear_python_test name script ranks)
  add_test(NAME ${name}
           COMMAND $<TARGET_FILE:dear-run> -n ${ranks} --timeout 120 --
                   ${DEAR_TORCH_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/python/${script} ${ARGN})
  set_tests_properties(${name} PROPERTIES
                       LABELS python
                       SKIP_RETURN_CODE 77
                       TIMEOUT 180
                       # Small operations dominate here: engines and waiters sleep rather than
                       # spin, so that 4 ranks share a 2-core machine without starving each
                       # other.
                       ENVIRONMENT "PYTHONPATH=${DEAR_PYTHON_DIR};DEAR_SPIN_US=0;DEAR_WAIT_SPIN_US=0;OMP_NUM_THREADS=1")
endfunction()

dear_python_test(python_collectives_2 test_collectives.py 2)
dear_python_test(python_collectives_4 test_collectives.py 4)
dear_python_test(python_training_2 test_training.py 2)
dear_python_test(python_training_4 test_training.py 4)
dear_python_test(python_features_2 test_features.py 2)
dear_python_test(python_fusion_2 test_fusion.py 2)
# DDP over the "dear" torch.distributed backend vs DDP over Gloo and a local reference, and
# dear.DistributedOptimizer vs DDP over Gloo.
dear_python_test(python_ddp_2 test_ddp.py 2)
dear_python_test(python_ddp_4 test_ddp.py 4)
dear_python_test(python_vs_ddp_2 test_vs_ddp.py 2)
# CUDA tensors: skipped (77, with the reason) without a CUDA build of dear and a GPU torch sees.
dear_python_test(python_cuda_2 test_cuda.py 2)

# The example must keep running: a short smoke run (its own checks are the loss and accuracy
# it prints; this only proves it starts, trains and exits cleanly).
add_test(NAME python_example_synthetic
         COMMAND $<TARGET_FILE:dear-run> -n 2 --timeout 120 --
                 ${DEAR_TORCH_PYTHON} ${PROJECT_SOURCE_DIR}/examples/train_synthetic.py
                 --steps 10 --log-every 5 --batch-size 8)
set_tests_properties(python_example_synthetic PROPERTIES
                     LABELS python SKIP_RETURN_CODE 77 TIMEOUT 180
                     ENVIRONMENT "PYTHONPATH=${DEAR_PYTHON_DIR};DEAR_SPIN_US=0;DEAR_WAIT_SPIN_US=0;OMP_NUM_THREADS=1")

# The DDP comparison example: a short smoke run of all three modes (its timings mean nothing
# here; the same loss in every mode is printed for a human to read).
add_test(NAME python_example_compare_ddp
         COMMAND $<TARGET_FILE:dear-run> -n 2 --timeout 120 --
                 ${DEAR_TORCH_PYTHON} ${PROJECT_SOURCE_DIR}/examples/compare_ddp.py
                 --model convnet --steps 2 --warmup 1 --batch 2)
set_tests_properties(python_example_compare_ddp PROPERTIES
                     LABELS python SKIP_RETURN_CODE 77 TIMEOUT 180
                     ENVIRONMENT "PYTHONPATH=${DEAR_PYTHON_DIR};DEAR_SPIN_US=0;DEAR_WAIT_SPIN_US=0;OMP_NUM_THREADS=1")

# The training benchmark (bench/torch_train_bench.py) must keep running: every policy on a tiny
# MLP, one round of one step. Its timings mean nothing here; --check fails the test unless all
# communicating policies end at the same loss.
add_test(NAME python_bench_torch_train
         COMMAND $<TARGET_FILE:dear-run> -n 2 --timeout 120 --env GLOO_SOCKET_IFNAME=lo --
                 ${DEAR_TORCH_PYTHON} ${PROJECT_SOURCE_DIR}/bench/torch_train_bench.py
                 --model mlp --width 64 --depth 2 --rounds 2 --steps 1 --warmup 1 --check
                 --policies local,dear,wfbp,bucket,ddp-gloo,ddp-dear)
set_tests_properties(python_bench_torch_train PROPERTIES
                     LABELS python SKIP_RETURN_CODE 77 TIMEOUT 180
                     ENVIRONMENT "PYTHONPATH=${DEAR_PYTHON_DIR};DEAR_SPIN_US=0;DEAR_WAIT_SPIN_US=0;OMP_NUM_THREADS=1")
# The same torch.distributed backend and collectives over the shared-memory transport.
dear_python_test(python_ddp_shm_4 test_ddp.py 4)
dear_python_test(python_collectives_shm_4 test_collectives.py 4)
set_property(TEST python_ddp_shm_4 python_collectives_shm_4 APPEND PROPERTY ENVIRONMENT
             DEAR_TRANSPORT=shm)
