# /v1/responses end to end: `metrale serve` on the tiny random Qwen3 of models/default, driven by the
# official OpenAI client (responses.create, responses.stream, stored responses, a function tool round
# trip with previous_response_id and replayed with store: false) and by the OpenAI Agents SDK (one
# agent run with a function tool, streamed and not). Both come from npm, pinned in tools/oracles;
# the tests fail, saying so, when node or the oracles are missing.
find_program(METRALE_NODE_EXECUTABLE node)
foreach(client responses agents)
  set(test_name server.${client}_client)
  if(METRALE_NODE_EXECUTABLE AND TARGET metrale)
    add_test(NAME ${test_name}
             COMMAND ${METRALE_NODE_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tools/oracles/${client}_client_test.mjs
                     --metrale $<TARGET_FILE:metrale> --model ${PROJECT_SOURCE_DIR}/models/default)
  else()
    add_test(NAME ${test_name}
             COMMAND sh -c "echo '${client} client test: node or the metrale target not found: run scripts/install-deps.sh' >&2; exit 1")
  endif()
  set_tests_properties(${test_name} PROPERTIES LABELS "server;oracle;client_sdk" TIMEOUT 400)
endforeach()
