# Latency emulation and study (issue 6): the link delay decorator and the emulated hosts.
dear_test(test_delay_channel SOURCES test_delay_channel.cc LIBS dear_collectives LABELS unit)
dear_test(test_delay_link SOURCES test_delay_link.cc LIBS dear_collectives LABELS unit
          PROPERTIES TIMEOUT 120)

# Ranks in network namespaces made by scripts/netns-cluster.sh; skips unless root.
dear_test(test_delay_netns SOURCES test_delay_netns.cc LIBS dear_transport LABELS multiproc
          PROPERTIES TIMEOUT 120)
target_compile_definitions(test_delay_netns PRIVATE
  DEAR_NETNS_SCRIPT="${PROJECT_SOURCE_DIR}/scripts/netns-cluster.sh"
  DEAR_WORKER_PATH="$<TARGET_FILE:dear-test-worker>")
add_dependencies(test_delay_netns dear-test-worker)
if(TARGET dear-bench)
  target_compile_definitions(test_delay_netns PRIVATE
    DEAR_BENCH_PATH="$<TARGET_FILE:dear-bench>")
  add_dependencies(test_delay_netns dear-bench)
endif()

# dear-run --link-delay.
dear_test(test_delay_run SOURCES test_delay_run.cc LABELS unit)
target_compile_definitions(test_delay_run PRIVATE DEAR_RUN_PATH="$<TARGET_FILE:dear-run>")
add_dependencies(test_delay_run dear-run)

# The alpha-beta cost model behind Algorithm::kAuto and dear-bench --calibrate.
dear_test(test_cost_model SOURCES test_cost_model.cc LIBS dear_collectives LABELS unit)

# dear-model: every all_reduce schedule, and rank ranges that reach 1024 (the study's modelled
# curves).
if(TARGET dear-model)
  set(model_file ${CMAKE_CURRENT_BINARY_DIR}/dear_model_smoke.json)
  file(WRITE ${model_file}
       "{\"alpha_us\": 30, \"beta_us_per_byte\": 0.001, \"reduce_us_per_byte\": 0.0002}\n")
  add_test(NAME dear_model_to_1024
           COMMAND dear-model --model ${model_file} --ranks 2..1024 -b 8 -e 8)
  set_tests_properties(dear_model_to_1024 PROPERTIES LABELS unit
    PASS_REGULAR_EXPRESSION "1024,8,tree,[0-9.]+,recursive_doubling")
endif()

# scripts/latency-study.sh end to end at its smallest: 2 ranks, 8 bytes, every algorithm, the
# calibration, the model's error summary and the modelled curves (PNGs only with gnuplot).
if(TARGET dear-bench AND TARGET dear-model)
  add_test(NAME latency_study_smoke
           COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/latency-study.sh --build ${PROJECT_BINARY_DIR}
                   --ranks 2 --delays 0 -b 8 -e 8 -n 2 -w 1 --min_time_ms 0 --model-ranks 64
                   --out ${CMAKE_CURRENT_BINARY_DIR}/latency-study-smoke/study.csv)
  set_tests_properties(latency_study_smoke PROPERTIES LABELS multiproc TIMEOUT 300
    PASS_REGULAR_EXPRESSION "median absolute relative error of the model: [0-9.]+% over 6 points")
endif()

# scripts/check-auto.sh end to end at its smallest: 2 ranks, two sizes, the calibration of
# every schedule, every algorithm and auto timed interleaved (dear-bench --compare), the grid.
if(TARGET dear-bench AND TARGET dear-model)
  add_test(NAME check_auto_smoke
           COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/check-auto.sh --build ${PROJECT_BINARY_DIR}
                   --ranks 2 -b 8 -e 32 -n 2 -w 1 --min_time_ms 0
                   --out ${CMAKE_CURRENT_BINARY_DIR}/check-auto-smoke)
  set_tests_properties(check_auto_smoke PROPERTIES LABELS multiproc TIMEOUT 300
    PASS_REGULAR_EXPRESSION "auto within 10% of the best forced algorithm: [0-9]+ of 2 points")
endif()
