# Fuzz targets (libFuzzer, tests/fuzz/fuzz_*.cpp) and their committed seed corpora
# (tests/fuzz/corpus/<target>/, every crash found included).
# - Every build compiles each target with a replay driver, fuzz_replay_<target>, and CTest runs it
#   over the corpus (fuzz.replay.<target>): the corpora are regression tests, sanitized in the
#   ASan build.
# - With -DMETRALE_FUZZ=ON (the clang sanitizer build; `make fuzz`, `make fuzz-ci`) each target is
#   also a libFuzzer executable, fuzz_<target>, and the code the targets exercise (the core, runtime
#   and text floors and the fuzz support library) carries libFuzzer's coverage instrumentation. The
#   ASan runtime supplies no-op coverage callbacks, so the test suites link the same libraries.
# - replay_main.cpp is compiled once, as the object library metrale_fuzz_replay_main.
set(METRALE_FUZZ_DIR ${PROJECT_SOURCE_DIR}/tests/fuzz)
set(METRALE_FUZZ_TARGETS request responses safetensors config tokenizer chat_template reasoning sse)

add_library(metrale_fuzz_replay_main OBJECT ${METRALE_FUZZ_DIR}/replay_main.cpp)
metrale_target_options(metrale_fuzz_replay_main)
add_library(metrale_fuzz_support STATIC
  ${METRALE_FUZZ_DIR}/fuzz_support.cpp
  ${PROJECT_SOURCE_DIR}/src/server/openai_protocol.cpp
  ${PROJECT_SOURCE_DIR}/src/server/request_fields.cpp
  ${PROJECT_SOURCE_DIR}/src/server/responses_api.cpp
  ${PROJECT_SOURCE_DIR}/src/server/response_events.cpp
  ${PROJECT_SOURCE_DIR}/src/model/safetensors.cpp
  ${PROJECT_SOURCE_DIR}/src/model/config.cpp)
metrale_target_options(metrale_fuzz_support)
target_include_directories(metrale_fuzz_support PUBLIC ${METRALE_FUZZ_DIR})
target_link_libraries(metrale_fuzz_support PUBLIC metrale_text metrale_runtime nlohmann_json::nlohmann_json)

if(METRALE_FUZZ)
  foreach(covered metrale_core metrale_runtime metrale_text metrale_fuzz_support)
    target_compile_options(${covered} PRIVATE -fsanitize=fuzzer-no-link)
  endforeach()
endif()

foreach(name ${METRALE_FUZZ_TARGETS})
  add_executable(fuzz_replay_${name} ${METRALE_FUZZ_DIR}/fuzz_${name}.cpp $<TARGET_OBJECTS:metrale_fuzz_replay_main>)
  metrale_target_options(fuzz_replay_${name})
  target_link_libraries(fuzz_replay_${name} PRIVATE metrale_fuzz_support)
  add_test(NAME fuzz.replay.${name} COMMAND fuzz_replay_${name} ${METRALE_FUZZ_DIR}/corpus/${name})
  set_tests_properties(fuzz.replay.${name} PROPERTIES LABELS "fuzz" TIMEOUT 300)
  if(METRALE_FUZZ)
    add_executable(fuzz_${name} ${METRALE_FUZZ_DIR}/fuzz_${name}.cpp)
    metrale_target_options(fuzz_${name})
    target_link_libraries(fuzz_${name} PRIVATE metrale_fuzz_support)
    target_compile_options(fuzz_${name} PRIVATE -fsanitize=fuzzer-no-link)
    target_link_options(fuzz_${name} PRIVATE -fsanitize=fuzzer)
    list(APPEND metrale_fuzzers fuzz_${name})
  endif()
endforeach()
if(METRALE_FUZZ)
  add_custom_target(fuzzers DEPENDS ${metrale_fuzzers})
endif()
