# What `metrale serve` writes while it starts, with stderr a pipe: one plain line per stage, and
# with --log-format json one JSON record per line, the stages as events ending in "ready" with the
# URL. Needs node (no npm package).
find_program(METRALE_NODE_EXECUTABLE node)
if(METRALE_NODE_EXECUTABLE AND TARGET metrale)
  add_test(NAME server.startup_lines
           COMMAND ${METRALE_NODE_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tools/oracles/startup_lines_test.mjs
                   --metrale $<TARGET_FILE:metrale> --model ${PROJECT_SOURCE_DIR}/models/default)
else()
  add_test(NAME server.startup_lines
           COMMAND sh -c "echo 'startup lines test: node or the metrale target not found: run scripts/install-deps.sh' >&2; exit 1")
endif()
set_tests_properties(server.startup_lines PROPERTIES LABELS "server;oracle" TIMEOUT 60)
