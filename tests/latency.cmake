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
