# cmake -DDEAR_RUN=... -DSTREAM=... -DPROVIDER=... -P fabric_stream_check.cmake
# Runs dear-fabric-stream on two ranks with a small message in four chunks and fails unless it
# exits 0 and rank 0 printed a GB/s figure for PROVIDER and for tcp, in both directions.
execute_process(COMMAND "${DEAR_RUN}" -n 2 --timeout 150 "${STREAM}" --provider "${PROVIDER}"
                        -s 1M --chunk 256K --iters 2 --warmup 1
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "dear-fabric-stream --provider '${PROVIDER}' exited with status ${rc}")
endif()
string(REPLACE "." "\\." provider_re "${PROVIDER}")
foreach(row IN ITEMS "${provider_re} +uni" "${provider_re} +bidi" "tcp +uni" "tcp +bidi")
  if(NOT out MATCHES "\\] ${row} +1048576 +[0-9.]+ +[0-9]+\\.[0-9]+")
    message(FATAL_ERROR "no GB/s row '${row}' in the output of dear-fabric-stream")
  endif()
endforeach()
