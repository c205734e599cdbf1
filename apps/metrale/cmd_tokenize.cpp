// metrale tokenize: the model's tokenizer on the command line. Encodes text to ids (--text, --file,
// --jsonl) or decodes ids to text (--decode, --decode-jsonl). The JSON Lines modes print one JSON
// value per input line, so that scripts such as tools/oracles/tokenizer_oracle.mjs can compare
// thousands of strings with Hugging Face tokenizers in one run.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "core/strings.h"
#include "options.h"
#include "runtime/device.h"
#include "runtime/thread_pool.h"
#include "text/tokenizer.h"

namespace metrale::cli {
namespace {

struct TokenizeOptions {
  EngineOptions engine;  // only --model is used: a tokenizer needs no weights
  std::string text;
  std::string file;
  std::string jsonl;
  std::string decode;
  std::string decode_jsonl;
  bool add_special_tokens = false;
  bool skip_special_tokens = false;
  // The input options, by count: "--text ''" (encode the empty string) is not "no --text".
  CLI::Option* text_option = nullptr;
  CLI::Option* file_option = nullptr;
  CLI::Option* jsonl_option = nullptr;
  CLI::Option* decode_option = nullptr;
  CLI::Option* decode_jsonl_option = nullptr;
};

// Buffers stdout writes; the JSON Lines modes print many short lines.
class Output {
 public:
  ~Output() { flush(); }
  Output() = default;
  Output(const Output&) = delete;
  Output& operator=(const Output&) = delete;

  void line(std::string_view text) {
    buffer_.append(text);
    buffer_.push_back('\n');
    if (buffer_.size() >= (1u << 20)) flush();
  }
  void flush() {
    if (!buffer_.empty()) std::fwrite(buffer_.data(), 1, buffer_.size(), stdout);
    buffer_.clear();
    std::fflush(stdout);
  }

 private:
  std::string buffer_;
};

std::string ids_json(const std::vector<int32_t>& ids) { return fmt::format("[{}]", fmt::join(ids, ",")); }

// Calls `on_value(value, line_number)` for each non-blank line of a JSON Lines file.
template <typename OnValue>
void for_each_json_line(const std::string& path, OnValue&& on_value) {
  const std::string content = read_file(path);
  size_t line_number = 0;
  size_t begin = 0;
  while (begin < content.size()) {
    size_t end = content.find('\n', begin);
    if (end == std::string::npos) end = content.size();
    ++line_number;
    const std::string_view line(content.data() + begin, end - begin);
    begin = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    nlohmann::json value;
    try {
      value = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      raise(ErrorCode::kBadFormat, "{}:{}: invalid JSON: {}", path, line_number, e.what());
    }
    on_value(value, line_number);
  }
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  for (const int64_t id : parse_int_list(text, "--decode")) {
    if (id < 0 || id > INT32_MAX) raise(ErrorCode::kInvalidArgument, "--decode: id {} is out of range", id);
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

int run_tokenize(const TokenizeOptions& options) {
  const auto given = [](const CLI::Option* option) { return option->count() > 0; };
  const int inputs = given(options.text_option) + given(options.file_option) + given(options.jsonl_option) +
                     given(options.decode_option) + given(options.decode_jsonl_option);
  if (inputs != 1) {
    raise(ErrorCode::kInvalidArgument, "give exactly one of --text, --file, --jsonl, --decode, --decode-jsonl");
  }
  if (!options.engine.device.empty()) parse_device(options.engine.device);  // rejects unknown devices
  apply_cpu_threads(options.engine);
  const Tokenizer tokenizer = Tokenizer::from_dir(resolve_model_dir(options.engine));
  Output out;

  if (given(options.decode_option)) {
    out.line(tokenizer.decode(parse_ids(options.decode), options.skip_special_tokens));
  } else if (given(options.decode_jsonl_option)) {
    for_each_json_line(options.decode_jsonl, [&](const nlohmann::json& value, size_t line_number) {
      std::vector<int32_t> ids;
      try {
        ids = value.get<std::vector<int32_t>>();
      } catch (const nlohmann::json::exception&) {
        raise(ErrorCode::kBadFormat, "{}:{}: expected a JSON array of token ids", options.decode_jsonl, line_number);
      }
      out.line(nlohmann::json(tokenizer.decode(ids, options.skip_special_tokens)).dump());
    });
  } else if (given(options.jsonl_option)) {
    for_each_json_line(options.jsonl, [&](const nlohmann::json& value, size_t line_number) {
      if (!value.is_string()) raise(ErrorCode::kBadFormat, "{}:{}: expected a JSON string", options.jsonl, line_number);
      out.line(ids_json(tokenizer.encode(value.get_ref<const std::string&>(), options.add_special_tokens)));
    });
  } else {
    const std::string text = given(options.file_option) ? read_file(options.file) : options.text;
    out.line(ids_json(tokenizer.encode(text, options.add_special_tokens)));
  }
  return kExitOk;
}

}  // namespace

void register_tokenize(CLI::App& root, Action& action) {
  auto options = std::make_shared<TokenizeOptions>();
  CLI::App* command = root.add_subcommand("tokenize", "Encode text to token ids or decode ids to text");
  add_model_option(*command, options->engine);
  options->text_option = command->add_option("--text", options->text, "text to encode; prints one JSON array of ids");
  options->file_option = command->add_option("--file", options->file, "encode the whole content of this file");
  options->jsonl_option = command->add_option("--jsonl", options->jsonl,
                                              "encode each line (a JSON string); prints one JSON array per line");
  options->decode_option = command->add_option("--decode", options->decode, "comma-separated ids to decode; prints the text");
  options->decode_jsonl_option = command->add_option(
      "--decode-jsonl", options->decode_jsonl, "decode each line (a JSON array of ids); prints one JSON string per line");
  command->add_flag("--add-special-tokens", options->add_special_tokens,
                    "add the tokens of the tokenizer's post-processor (as HF add_special_tokens=True)");
  command->add_flag("--skip-special-tokens", options->skip_special_tokens, "leave special tokens out when decoding");
  // Tokenization runs on the CPU; the flags are accepted (and checked) like everywhere else.
  add_device_options(*command, options->engine);
  command->callback([options, &action] { action = [options] { return run_tokenize(*options); }; });
}

}  // namespace metrale::cli
