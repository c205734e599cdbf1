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

# The chat-template differential test: every fixture template (tests/text/chat_templates/) x every
# conversation (tests/text/chat_conversations.json) rendered by @huggingface/jinja (npm) and by
# metrale (the ChatTemplateOracle test of metrale_text_tests), compared byte for byte. Like the
# tokenizer oracle it fails, saying so, when node or the npm oracles are missing.
if(METRALE_NODE_EXECUTABLE)
  add_test(NAME text.chat_template_oracle
           COMMAND ${METRALE_NODE_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tools/oracles/render_chat.mjs
                   --test-binary $<TARGET_FILE:metrale_text_tests>)
else()
  add_test(NAME text.chat_template_oracle
           COMMAND sh -c "echo 'chat template oracle: node not found: run scripts/install-deps.sh' >&2; exit 1")
endif()
set_tests_properties(text.chat_template_oracle PROPERTIES LABELS "text;oracle" TIMEOUT 300)
