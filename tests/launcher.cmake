# dear-run's end-to-end tests; tests/CMakeLists.txt include()s this file after defining
# dear_test().
if(TARGET dear-run)
  dear_test(test_dear_run SOURCES test_dear_run.cc LIBS dear_transport LABELS multiproc)
  if(TARGET test_dear_run)
    target_compile_definitions(test_dear_run PRIVATE DEAR_RUN_PATH="$<TARGET_FILE:dear-run>")
    add_dependencies(test_dear_run dear-run)
  endif()
endif()
