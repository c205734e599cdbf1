# Tool calling and structured outputs through the clients people use (tools/oracles/clients_test.mjs):
# the official openai client (tools, forced calls, JSON schemas, logit_bias), the Vercel AI SDK
# (generateText, streamText, generateObject with zod, a tool call) and LangChain JS (invoke, stream,
# bindTools, withStructuredOutput), each against `metrale serve` on models/default. They need the npm
# oracles (scripts/install-deps.sh) and fail, saying so, when they are missing.
find_program(METRALE_NODE_EXECUTABLE node)
foreach(client openai ai-sdk langchain)
  set(test_name server.client_${client})
  if(METRALE_NODE_EXECUTABLE AND TARGET metrale)
    add_test(NAME ${test_name}
             COMMAND ${METRALE_NODE_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tools/oracles/clients_test.mjs
                     --metrale $<TARGET_FILE:metrale> --client ${client} --model ${PROJECT_SOURCE_DIR}/models/default)
  else()
    add_test(NAME ${test_name}
             COMMAND sh -c "echo '${client} client test: node or the metrale target not found: run scripts/install-deps.sh' >&2; exit 1")
  endif()
  # 400 s: the sanitizer build serves the demo model several times slower (45 s in Release).
  set_tests_properties(${test_name} PROPERTIES LABELS "server;oracle;client_sdk" TIMEOUT 400)
endforeach()
