# cmake -DDEAR_RUN=... -DSTREAM=... -DPROVIDER=... -DOP=send|write [-DRANKS=n] -P fabric_stream_check.cmake
# Runs dear-fabric-stream on RANKS ranks (default two; more make a ring, each rank writing to the
# next and crediting the previous) with small messages in four chunks, six of them through
# two slots (so that with writes the receiver's credits pace the sender), and fails unless it
# exits 0 (every message arrived with its stamps) and rank 0 printed a GB/s figure for PROVIDER
# and for tcp, in both directions, moved the way OP says.
if(NOT DEFINED RANKS)
  set(RANKS 2)
endif()
execute_process(COMMAND "${DEAR_RUN}" -n ${RANKS} --timeout 150 "${STREAM}" --provider "${PROVIDER}"
                        -s 1M --chunk 256K --iters 4 --warmup 2 --window 2 --op "${OP}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "dear-fabric-stream --provider '${PROVIDER}' exited with status ${rc}")
endif()
if(OP STREQUAL "write")
  set(way "RMA writes with remote CQ data")
else()
  set(way ", sends")
endif()
string(FIND "${out}" "${way}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "dear-fabric-stream --op ${OP} did not say it moved chunks as '${way}'")
endif()
string(REPLACE "." "\\." provider_re "${PROVIDER}")
foreach(row IN ITEMS "${provider_re} +uni" "${provider_re} +bidi" "tcp +uni" "tcp +bidi")
  if(NOT out MATCHES "\\] ${row} +1048576 +[0-9.]+ +[0-9]+\\.[0-9]+")
    message(FATAL_ERROR "no GB/s row '${row}' in the output of dear-fabric-stream")
  endif()
endforeach()
