# The tokenizer's differential test: `metrale tokenize` against Hugging Face tokenizers (the Rust
# library from npm) on thousands of generated strings, for the Qwen3 and DeepSeek-V3 tokenizers.
# It needs the npm oracles (scripts/install-deps.sh) and fails, saying so, when they are missing:
# this test must never be skipped.
find_program(METRALE_NODE_EXECUTABLE node)
if(METRALE_NODE_EXECUTABLE)
  add_test(NAME text.tokenizer_oracle
           COMMAND ${METRALE_NODE_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tools/oracles/tokenizer_oracle.mjs
                   --metrale $<TARGET_FILE:metrale>)
else()
  add_test(NAME text.tokenizer_oracle
           COMMAND sh -c "echo 'tokenizer oracle: node not found: run scripts/install-deps.sh' >&2; exit 1")
endif()
set_tests_properties(text.tokenizer_oracle PROPERTIES LABELS "text;oracle" TIMEOUT 900)
