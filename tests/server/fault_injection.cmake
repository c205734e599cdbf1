# Failure containment end to end: `metrale serve` on the demo model with METRALE_FAULT_INJECT at
# each site (forward, sample, verify, commit, mtp, recover), checked with raw HTTP from node
# (tools/oracles/fault_injection_test.mjs): clean errors for the failing request, the greedy
# output of a server without faults for new ones, and a /health that tells the truth.
# Sanitizer builds run one case per site (--small).
find_program(METRALE_NODE_EXECUTABLE node)
set(metrale_fault_cases "")
if(METRALE_SANITIZE)
  set(metrale_fault_cases "--small")
endif()
if(METRALE_NODE_EXECUTABLE AND TARGET metrale)
  add_test(NAME server.fault_injection
           COMMAND ${METRALE_NODE_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tools/oracles/fault_injection_test.mjs
                   --metrale $<TARGET_FILE:metrale> --model ${PROJECT_SOURCE_DIR}/models/demo ${metrale_fault_cases})
else()
  add_test(NAME server.fault_injection
           COMMAND sh -c "echo 'fault injection test: node or the metrale target not found: run scripts/install-deps.sh' >&2; exit 1")
endif()
set_tests_properties(server.fault_injection PROPERTIES LABELS "server;oracle" TIMEOUT 600)
