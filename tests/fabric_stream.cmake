# dear-fabric-stream (bench/fabric_stream.cc) at its smallest, once per provider and way of
# moving chunks (sends, RMA writes): two ranks through dear-run, chunked messages, both
# directions, more messages than slots; fabric_stream_check.cmake checks the exit status and that
# a GB/s figure came out for the provider and for tcp. Skips, naming the reason, where the
# provider is missing. Included from tests/CMakeLists.txt.
if(TARGET dear-fabric-stream AND TARGET dear-run)
  foreach(provider IN ITEMS rxm shm)
    if(provider STREQUAL "rxm")
      set(name "tcp$<SEMICOLON>ofi_rxm")  # a plain ';' would split the command
    else()
      set(name "${provider}")
    endif()
    foreach(op IN ITEMS send write)
      add_test(NAME fabric_stream_${op}_${provider}
               COMMAND ${CMAKE_COMMAND} -DDEAR_RUN=$<TARGET_FILE:dear-run>
                       -DSTREAM=$<TARGET_FILE:dear-fabric-stream> "-DPROVIDER=${name}" -DOP=${op}
                       -P ${CMAKE_CURRENT_LIST_DIR}/fabric_stream_check.cmake)
      set_tests_properties(fabric_stream_${op}_${provider} PROPERTIES LABELS fabric TIMEOUT 180
        SKIP_REGULAR_EXPRESSION "is not available here")
    endforeach()
  endforeach()
endif()
