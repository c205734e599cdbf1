# Hostile clients against the real `metrale serve` on the bundled demo model (loopback only):
# tools/oracles/hostile_client_test.mjs, with a canary stream and /health checked after every case.
# Sockets are descriptors, so the soft limit is raised to the hard one first. Sanitizer builds run
# the same cases with fewer sockets (--small).
find_program(METRALE_NODE_EXECUTABLE node)
set(metrale_hostile_sizes "")
if(METRALE_SANITIZE)
  set(metrale_hostile_sizes "--small")
endif()
if(METRALE_NODE_EXECUTABLE AND TARGET metrale)
  add_test(NAME server.hostile_clients
           COMMAND sh -c "ulimit -n \"$(ulimit -Hn)\" 2>/dev/null; exec \"$0\" \"$@\""
                   ${METRALE_NODE_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tools/oracles/hostile_client_test.mjs
                   --metrale $<TARGET_FILE:metrale> --model ${PROJECT_SOURCE_DIR}/models/demo ${metrale_hostile_sizes})
else()
  add_test(NAME server.hostile_clients
           COMMAND sh -c "echo 'hostile client test: node or the metrale target not found: run scripts/install-deps.sh' >&2; exit 1")
endif()
set_tests_properties(server.hostile_clients PROPERTIES LABELS "server;oracle" TIMEOUT 900)
