# The server end to end: `metrale serve` on the tiny random Qwen3 of models/default, driven by the official
# OpenAI client (openai@6 from npm, pinned in tools/oracles): completions and chat, streaming,
# n > 1, stop strings, logprobs, seeds, 64 concurrent streams, every bad input, disconnects, the
# API key, a full queue, `metrale bench-serve` and `metrale chat` over a pipe. It needs the npm
# oracles (scripts/install-deps.sh) and fails, saying so, when they are missing.
find_program(METRALE_NODE_EXECUTABLE node)
if(METRALE_NODE_EXECUTABLE AND TARGET metrale)
  add_test(NAME server.openai_client
           COMMAND ${METRALE_NODE_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tools/oracles/openai_server_test.mjs
                   --metrale $<TARGET_FILE:metrale> --model ${PROJECT_SOURCE_DIR}/models/default)
else()
  add_test(NAME server.openai_client
           COMMAND sh -c "echo 'openai server test: node or the metrale target not found: run scripts/install-deps.sh' >&2; exit 1")
endif()
set_tests_properties(server.openai_client PROPERTIES LABELS "server;oracle" TIMEOUT 300)
