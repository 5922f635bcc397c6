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
  # Three ranks: a ring, where a rank's writes go to one neighbour and its credits to the other.
  add_test(NAME fabric_stream_write_rxm_ring
           COMMAND ${CMAKE_COMMAND} -DDEAR_RUN=$<TARGET_FILE:dear-run>
                   -DSTREAM=$<TARGET_FILE:dear-fabric-stream> "-DPROVIDER=tcp$<SEMICOLON>ofi_rxm"
                   -DOP=write -DRANKS=3 -P ${CMAKE_CURRENT_LIST_DIR}/fabric_stream_check.cmake)
  set_tests_properties(fabric_stream_write_rxm_ring PROPERTIES LABELS fabric TIMEOUT 180
    SKIP_REGULAR_EXPRESSION "is not available here")
endif()

# dear-tcp-ring (bench/tcp_ring.cc): a ring collective's bytes streamed over plain sockets. Three
# ranks, an odd size; every message is checked on arrival, so a run that exits 0 and prints its
# figure moved the data. A size too small to carry the check is refused on every rank.
if(TARGET dear-tcp-ring AND TARGET dear-run)
  add_test(NAME tcp_ring_streams
           COMMAND bash -c "set -euo pipefail
             out=$($<TARGET_FILE:dear-run> -n 3 $<TARGET_FILE:dear-tcp-ring> --all-reduce 300007 --iters 5 --warmup 2 --rounds 2)
             echo \"$out\"
             grep -q '400009 B per rank per iteration' <<<\"$out\"
             grep -Eq 'median [0-9.]+ us per iteration' <<<\"$out\"")
  add_test(NAME tcp_ring_refuses_tiny_messages
           COMMAND bash -c "set -uo pipefail
             if out=$($<TARGET_FILE:dear-run> -n 2 $<TARGET_FILE:dear-tcp-ring> -s 8 2>&1); then
               echo \"accepted 8-byte messages: $out\"; exit 1
             fi
             echo \"$out\"
             grep -q 'too few; at least 16' <<<\"$out\"")
  set_tests_properties(tcp_ring_streams tcp_ring_refuses_tiny_messages
                       PROPERTIES LABELS multiproc TIMEOUT 120)
endif()

# dear-socket-stream (bench/socket_stream.cc): one loopback stream through a reused buffer and
# through a walked one, every chunk checked on arrival; a chunk that does not divide the walked
# buffer is refused.
if(TARGET dear-socket-stream)
  add_test(NAME socket_stream_reused_and_walked
           COMMAND bash -c "set -euo pipefail
             out=$($<TARGET_FILE:dear-socket-stream> --message 1M --chunk 64K --bytes 16M --rounds 2)
             echo \"$out\"
             grep -Eq '^ +1 +[0-9.]+ +[0-9.]+ +[0-9.]+$' <<<\"$out\"
             grep -Eq '^median +[0-9.]+ +[0-9.]+ +[0-9.]+$' <<<\"$out\"")
  add_test(NAME socket_stream_refuses_a_chunk_that_does_not_divide
           COMMAND bash -c "set -uo pipefail
             if out=$($<TARGET_FILE:dear-socket-stream> --message 1M --chunk 3K 2>&1); then
               echo \"accepted it: $out\"; exit 1
             fi
             echo \"$out\"
             grep -q 'divide --message' <<<\"$out\"")
  set_tests_properties(socket_stream_reused_and_walked
                       socket_stream_refuses_a_chunk_that_does_not_divide
                       PROPERTIES LABELS multiproc TIMEOUT 60)
endif()
