// Supported tokenizer.json features (everything else raises kUnsupported when loading):
//   model           BPE (vocab; merges as [a, b] pairs or "a b" strings; unk_token, fuse_unk,
//                   byte_fallback, ignore_merges; dropout null or 0; no subword prefix/suffix)
//   normalizer      null, NFC, NFD, NFKC, NFKD, Sequence of those (possibly empty)
//   pre_tokenizer   ByteLevel, or Sequence of Split (Regex or String pattern, any behavior,
//                   invert) ending with ByteLevel (add_prefix_space, use_regex)
//   post_processor  null, ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing,
//                   Sequence of those (single-sequence templates)
//   decoder         ByteLevel
//   added_tokens    special or not; single_word, lstrip, rstrip, normalized
// "truncation" and "padding" are ignored: an inference engine must never cut a prompt silently.
#include "text/tokenizer.h"

#include <algorithm>
#include <limits>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_depth.h"
#include "core/log.h"
#include "core/strings.h"
#include "text/byte_level.h"
#include "text/json_util.h"
#include "text/tokenizer_data.h"
#include "text/utf8.h"

namespace metrale {

namespace text {

namespace {

// Per-thread buffers reused by every encode() on that thread.
struct EncodeScratch {
  std::vector<AddedTokenMatcher::Segment> raw_segments;
  std::vector<AddedTokenMatcher::Segment> normalized_segments;
  std::string normalized;
  PreTokenizeScratch pre_tokenize;
  std::vector<std::string_view> pieces;
};

EncodeScratch& encode_scratch() {
  thread_local EncodeScratch scratch;
  return scratch;
}

// ---------------------------------------------------------------------------------------------
// Added tokens

// The "added_tokens" array (null: none), in file order.
std::vector<AddedToken> parse_added_tokens(const json::Json& entries) {
  std::vector<AddedToken> tokens;
  if (entries.is_null()) return tokens;
  for (const json::Json& entry : json::array(entries, "added_tokens")) {
    try {
      const auto content = json::string(entry, "content");
      if (!content) raise(ErrorCode::kBadFormat, "expected an object with a string \"content\"");
      AddedToken token;
      token.content = *content;
      if (!is_valid_utf8(token.content)) raise(ErrorCode::kBadFormat, "content is not valid UTF-8");
      if (const json::Json* id = json::member(entry, "id"); id != nullptr && id->is_number_integer()) {
        if (id->get<int64_t>() < 0 || id->get<int64_t>() >= (int64_t{1} << 24))
          raise(ErrorCode::kBadFormat, "the id of '{}' must be in [0, 2^24)", token.content);
        token.id = static_cast<int32_t>(id->get<int64_t>());
      }
      token.special = json::boolean(entry, "special", false);
      token.single_word = json::boolean(entry, "single_word", false);
      token.lstrip = json::boolean(entry, "lstrip", false);
      token.rstrip = json::boolean(entry, "rstrip", false);
      token.normalized = json::boolean(entry, "normalized", !token.special);
      tokens.push_back(std::move(token));
    } catch (const Error& e) {
      rethrow_with_context(e, "[{}]", tokens.size());
    }
  }
  return tokens;
}

bool same_token(const AddedToken& a, const AddedToken& b) {
  return a.content == b.content && a.single_word == b.single_word && a.lstrip == b.lstrip && a.rstrip == b.rstrip &&
         a.normalized == b.normalized && a.special == b.special;
}

// Registers the added tokens one at a time, assigning ids as HF's AddedVocabulary::add_tokens
// does when it deserializes tokenizer.json: a token already known (as an added token or in the
// vocab) keeps that id; a new one gets the next id after the largest added id, or the vocab size.
// A file written by HF always agrees; a disagreement is logged and HF's id wins.
void register_added_tokens(TokenizerData& data, std::vector<AddedToken> file_tokens,
                           std::map<int32_t, AddedToken>& by_id) {
  const auto vocab_count = static_cast<int64_t>(data.model.vocab_count());
  for (AddedToken& token : file_tokens) {
    if (token.content.empty()) continue;
    const auto known = data.added_token_ids.find(token.content);
    if (known != data.added_token_ids.end() && same_token(by_id.at(known->second), token)) continue;
    int32_t id;
    if (known != data.added_token_ids.end()) {
      id = known->second;
    } else if (const auto in_vocab = data.model.token_to_id(token.content)) {
      id = *in_vocab;
    } else if (by_id.empty()) {
      id = static_cast<int32_t>(vocab_count);
    } else {
      const int64_t largest = by_id.rbegin()->first;
      id = static_cast<int32_t>(largest >= vocab_count || vocab_count == 0 ? largest + 1 : vocab_count);
    }
    if (token.id >= 0 && token.id != id) {
      METRALE_LOG_WARN("added token '{}' has id {} in tokenizer.json but gets id {} (as in HF tokenizers)", token.content,
                       token.id, id);
    }
    token.id = id;
    data.added_token_ids.insert_or_assign(token.content, id);
    by_id.insert_or_assign(id, token);
  }
}

// ---------------------------------------------------------------------------------------------
// Post-processor: what add_special_tokens puts around one sequence.

std::vector<int32_t> template_token_ids(const json::Json& special_tokens, const std::string& name) {
  const json::Json* token = json::member(special_tokens, name);
  const json::Json* ids = token != nullptr ? json::member(*token, "ids") : nullptr;
  if (ids == nullptr) raise(ErrorCode::kBadFormat, "TemplateProcessing: special token '{}' is not in \"special_tokens\"", name);
  std::vector<int32_t> values;
  for (const auto& id : json::array(*ids, "TemplateProcessing special token ids")) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max())
      raise(ErrorCode::kBadFormat, "TemplateProcessing: special token '{}' has an id that is not a token id", name);
    values.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return values;
}

int32_t processor_token_id(const json::Json& spec, const char* key) {
  const json::Json* pair = json::member(spec, key);
  if (pair == nullptr || !pair->is_array() || pair->size() != 2 || !(*pair)[1].is_number_integer() ||
      (*pair)[1].get<int64_t>() < 0 || (*pair)[1].get<int64_t>() > std::numeric_limits<int32_t>::max()) {
    raise(ErrorCode::kBadFormat, "post_processor.{} must be [token, id]", key);
  }
  return static_cast<int32_t>((*pair)[1].get<int64_t>());
}

void parse_post_processor(const json::Json& spec, std::vector<int32_t>& prefix, std::vector<int32_t>& suffix) {
  if (spec.is_null()) return;
  const std::string type = json::type_of(spec, "post_processor");
  std::vector<int32_t> before;
  std::vector<int32_t> after;
  if (type == "ByteLevel") {
    return;  // only trims offsets
  } else if (type == "Sequence") {
    const json::Json* processors = json::member(spec, "processors");
    if (processors == nullptr) raise(ErrorCode::kBadFormat, "post_processor Sequence: missing \"processors\"");
    for (const auto& child : json::array(*processors, "processors")) parse_post_processor(child, prefix, suffix);
    return;
  } else if (type == "TemplateProcessing") {
    const json::Json* single = json::member(spec, "single");
    const json::Json* special_tokens = json::member(spec, "special_tokens");
    if (single == nullptr || special_tokens == nullptr) {
      raise(ErrorCode::kBadFormat, "TemplateProcessing: needs \"single\" and \"special_tokens\"");
    }
    bool seen_sequence = false;
    for (const auto& piece : json::array(*single, "TemplateProcessing.single")) {
      const json::Json* special = json::member(piece, "SpecialToken");
      const auto special_name = special != nullptr ? json::string(*special, "id") : std::nullopt;
      if (json::member(piece, "Sequence") != nullptr) {
        if (seen_sequence) raise(ErrorCode::kUnsupported, "TemplateProcessing: a single template with $A twice");
        seen_sequence = true;
      } else if (special_name) {
        const auto ids = template_token_ids(*special_tokens, *special_name);
        auto& side = seen_sequence ? after : before;
        side.insert(side.end(), ids.begin(), ids.end());
      } else {
        raise(ErrorCode::kUnsupported, "TemplateProcessing: template piece {} is not supported", piece.dump());
      }
    }
    if (!seen_sequence) raise(ErrorCode::kUnsupported, "TemplateProcessing: a single template without $A");
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    before.push_back(processor_token_id(spec, "cls"));
    after.push_back(processor_token_id(spec, "sep"));
  } else {
    raise(ErrorCode::kUnsupported, "post_processor type '{}' is not supported", type);
  }
  // A later processor wraps what the earlier ones produced.
  prefix.insert(prefix.begin(), before.begin(), before.end());
  suffix.insert(suffix.end(), after.begin(), after.end());
}

void check_decoder(const json::Json& spec) {
  if (spec.is_null()) raise(ErrorCode::kUnsupported, "decoder is null: only the ByteLevel decoder is supported");
  const std::string type = json::type_of(spec, "decoder");
  if (type != "ByteLevel") raise(ErrorCode::kUnsupported, "decoder type '{}' is not supported (only ByteLevel)", type);
}

// ---------------------------------------------------------------------------------------------
// tokenizer_config.json

// A special token entry: a string, an AddedToken object ({"content": ...}) or null.
std::optional<std::string> config_token(const json::Json& config, const char* key) {
  const json::Json* value = json::member(config, key);
  if (value == nullptr) return std::nullopt;
  if (value->is_string()) return value->get<std::string>();
  if (auto content = json::string(*value, "content")) return content;
  raise(ErrorCode::kBadFormat, "\"{}\" must be a string, an AddedToken object or null", key);
}

std::string config_chat_template(const json::Json& config) {
  const json::Json* value = json::member(config, "chat_template");
  if (value == nullptr) return {};
  if (value->is_string()) return value->get<std::string>();
  // Named templates, [{"name": ..., "template": ...}]: transformers' default is "default".
  for (const auto& entry : json::array(*value, "\"chat_template\" (a string or a list of named templates)")) {
    if (json::string(entry, "name") == "default") {
      if (auto text = json::string(entry, "template")) return std::move(*text);
    }
  }
  return {};
}

}  // namespace

std::shared_ptr<TokenizerData> build_tokenizer_data(const json::Json& root, bool enable_cache) {
  json::object(root, "tokenizer.json");
  if (const auto version = json::string(root, "version"); version && *version != "1.0") {
    raise(ErrorCode::kUnsupported, "tokenizer.json version '{}' is not supported (only 1.0)", *version);
  }
  auto data = std::make_shared<TokenizerData>();
  const auto section = [&](const char* key) -> const json::Json& {
    static const json::Json null_json;
    const json::Json* value = json::member(root, key);
    return value != nullptr ? *value : null_json;
  };
  const auto in_section = [&](const char* key, auto&& build) {
    try {
      build(section(key));
    } catch (const Error& e) {
      rethrow_with_context(e, "{}", key);
    }
  };

  if (section("model").is_null()) raise(ErrorCode::kBadFormat, "missing \"model\"");
  in_section("model", [&](const json::Json& spec) { data->model = BpeModel::from_json(spec, enable_cache); });
  in_section("normalizer", [&](const json::Json& spec) { data->normalizer = Normalizer::from_json(spec); });
  in_section("pre_tokenizer", [&](const json::Json& spec) { data->pre_tokenizer = PreTokenizer::from_json(spec); });
  in_section("post_processor", [&](const json::Json& spec) {
    parse_post_processor(spec, data->special_prefix, data->special_suffix);
  });
  in_section("decoder", [&](const json::Json& spec) { check_decoder(spec); });

  std::map<int32_t, AddedToken> added_by_id;
  in_section("added_tokens", [&](const json::Json& entries) {
    register_added_tokens(*data, parse_added_tokens(entries), added_by_id);
  });

  // The two matchers. A normalized token is looked for in its normalized form.
  std::vector<std::string> raw_patterns;
  std::vector<AddedToken> raw_tokens;
  std::vector<std::string> normalized_patterns;
  std::vector<AddedToken> normalized_tokens;
  std::unordered_map<int32_t, std::string> decode_form;  // HF's simple_id_to_token for added ids
  std::unordered_set<std::string> special_contents;
  for (const auto& [id, token] : added_by_id) {
    data->added_tokens.push_back(token);
    if (token.special) special_contents.insert(token.content);
    if (token.normalized) {
      std::string buffer;
      const std::string pattern(data->normalizer.normalize(token.content, buffer));
      decode_form[id] = pattern;
      normalized_patterns.push_back(pattern);
      normalized_tokens.push_back(token);
    } else {
      decode_form[id] = token.content;
      raw_patterns.push_back(token.content);
      raw_tokens.push_back(token);
    }
  }
  data->raw_matcher = AddedTokenMatcher(raw_patterns, raw_tokens);
  data->normalized_matcher = AddedTokenMatcher(normalized_patterns, normalized_tokens);

  // Decoding tables. HF decodes an id through the added vocabulary first, then the model; the
  // ByteLevel decoder maps a token's characters back to bytes when all of them are in the
  // alphabet and keeps the token's UTF-8 text otherwise (e.g. "<｜begin▁of▁sentence｜>").
  int64_t max_id = data->model.max_id();
  if (!added_by_id.empty()) max_id = std::max<int64_t>(max_id, added_by_id.rbegin()->first);
  // The decoding tables are indexed by id: a stray huge id must not size them (the largest real
  // vocabularies hold a few hundred thousand tokens).
  constexpr int64_t kMaxVocab = int64_t{1} << 24;
  if (max_id >= kMaxVocab)
    raise(ErrorCode::kBadFormat, "token id {} is beyond the {} ids a vocabulary may use", max_id, kMaxVocab);
  data->vocab_size = max_id + 1;
  // The post-processor's ids must name tokens: add_special_tokens would emit them as they are.
  for (const auto* ids : {&data->special_prefix, &data->special_suffix}) {
    for (const int32_t id : *ids) {
      if (id < 0 || id >= data->vocab_size) {
        raise(ErrorCode::kBadFormat, "post_processor: special token id {} is not in the vocabulary (ids 0 to {})", id,
              data->vocab_size - 1);
      }
    }
  }
  data->token_bytes_offsets.assign(static_cast<size_t>(data->vocab_size) + 1, 0);
  data->special.assign(static_cast<size_t>(data->vocab_size), 0);
  for (int64_t id = 0; id < data->vocab_size; ++id) {
    const std::string* token = nullptr;
    if (const auto it = decode_form.find(static_cast<int32_t>(id)); it != decode_form.end()) {
      token = &it->second;
    } else {
      token = data->model.id_to_token(static_cast<int32_t>(id));
    }
    if (token != nullptr) {
      if (auto bytes = byte_level_decode(*token)) {
        data->token_bytes += *bytes;
      } else {
        data->token_bytes += *token;
      }
      // HF's skip_special_tokens tests the token string against the special tokens' contents.
      data->special[id] = special_contents.contains(*token) ? 1 : 0;
    }
    if (data->token_bytes.size() > std::numeric_limits<uint32_t>::max()) {
      raise(ErrorCode::kUnsupported, "vocabulary larger than 4 GiB");
    }
    data->token_bytes_offsets[id + 1] = static_cast<uint32_t>(data->token_bytes.size());
  }

  return data;
}

void apply_tokenizer_config(TokenizerData& data, const json::Json& config) {
  json::object(config, "tokenizer_config.json");
  const auto resolve = [&](const char* key) -> std::optional<int32_t> {
    const auto content = config_token(config, key);
    if (!content) return std::nullopt;
    if (const auto it = data.added_token_ids.find(*content); it != data.added_token_ids.end()) return it->second;
    if (const auto id = data.model.token_to_id(*content)) return id;
    METRALE_LOG_WARN("tokenizer_config.json: {} '{}' is not in the vocabulary", key, *content);
    return std::nullopt;
  };
  data.eos_id = resolve("eos_token");
  data.bos_id = resolve("bos_token");
  data.add_bos_token = json::boolean(config, "add_bos_token", false);
  data.chat_template = config_chat_template(config);
}

// ---------------------------------------------------------------------------------------------
// Encoding

void TokenizerData::encode(std::string_view input, std::vector<int32_t>& ids) const {
  std::string repaired;
  std::string_view text = input;
  if (!is_valid_utf8(text)) {
    repaired = to_valid_utf8_lossy(input);
    text = repaired;
  }
  EncodeScratch& scratch = encode_scratch();
  auto& segments = scratch.raw_segments;
  segments.clear();
  raw_matcher.split(text, segments);
  for (const auto& segment : segments) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
    } else {
      encode_text(text.substr(segment.begin, segment.end - segment.begin), ids);
    }
  }
}

void TokenizerData::encode_text(std::string_view text, std::vector<int32_t>& ids) const {
  EncodeScratch& scratch = encode_scratch();
  const std::string_view normalized = normalizer.normalize(text, scratch.normalized);
  if (normalized_matcher.empty()) {
    encode_pre_tokenized(normalized, ids);
    return;
  }
  auto& segments = scratch.normalized_segments;
  segments.clear();
  normalized_matcher.split(normalized, segments);
  for (const auto& segment : segments) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
    } else {
      encode_pre_tokenized(normalized.substr(segment.begin, segment.end - segment.begin), ids);
    }
  }
}

void TokenizerData::encode_pre_tokenized(std::string_view text, std::vector<int32_t>& ids) const {
  EncodeScratch& scratch = encode_scratch();
  auto& pieces = scratch.pieces;
  pieces.clear();
  pre_tokenizer.split(text, scratch.pre_tokenize, pieces);
  for (const std::string_view piece : pieces) model.encode_word(piece, ids);
}

}  // namespace text

// ---------------------------------------------------------------------------------------------
// Tokenizer

namespace {

// tokenizer.json nests a few levels (a Sequence of normalizers, a TemplateProcessing's pieces);
// deeper text is not a tokenizer, and nlohmann's conversions recurse once per level.
constexpr size_t kMaxTokenizerJsonDepth = 64;

nlohmann::json parse_json_text(std::string_view content, std::string_view source) {
  if (json_nests_deeper_than(content, kMaxTokenizerJsonDepth))
    raise(ErrorCode::kBadFormat, "{}: invalid JSON: nested deeper than {}", source, kMaxTokenizerJsonDepth);
  try {
    return nlohmann::json::parse(content);
  } catch (const nlohmann::json::exception& e) {
    raise(ErrorCode::kBadFormat, "{}: invalid JSON: {}", source, e.what());
  }
}

// Errors name the file they come from; nlohmann's type errors (a value of an unexpected type deep
// inside) become kBadFormat too.
template <typename Build>
void with_context(std::string_view source, Build&& build) {
  try {
    build();
  } catch (const Error& e) {
    rethrow_with_context(e, "{}", source);
  } catch (const nlohmann::json::exception& e) {
    raise(ErrorCode::kBadFormat, "{}: {}", source, e.what());
  }
}

}  // namespace

Tokenizer Tokenizer::from_json_text(std::string_view tokenizer_json, std::string_view config_json,
                                    std::string_view chat_template, std::string_view source) {
  const std::string tokenizer_source = (std::filesystem::path(source) / "tokenizer.json").string();
  const nlohmann::json tokenizer = parse_json_text(tokenizer_json, tokenizer_source);
  std::shared_ptr<text::TokenizerData> data;
  with_context(tokenizer_source, [&] { data = text::build_tokenizer_data(tokenizer); });
  if (!config_json.empty()) {
    const std::string config_source = (std::filesystem::path(source) / "tokenizer_config.json").string();
    const nlohmann::json config = parse_json_text(config_json, config_source);
    with_context(config_source, [&] { text::apply_tokenizer_config(*data, config); });
  }
  if (!chat_template.empty()) data->chat_template = std::string(chat_template);
  return Tokenizer(std::move(data));
}

Tokenizer Tokenizer::from_dir(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir)) raise(ErrorCode::kNotFound, "tokenizer directory {} does not exist", dir.string());
  const std::filesystem::path tokenizer_path = dir / "tokenizer.json";
  if (!std::filesystem::is_regular_file(tokenizer_path)) {
    raise(ErrorCode::kNotFound, "{} not found (metrale reads Hugging Face tokenizer.json files)", tokenizer_path.string());
  }
  const std::string tokenizer_json = read_file(tokenizer_path);
  std::string config_json;
  if (const auto config_path = dir / "tokenizer_config.json"; std::filesystem::is_regular_file(config_path)) {
    config_json = read_file(config_path);
    // An empty file is not "no config": it is malformed JSON.
    if (config_json.empty()) raise(ErrorCode::kBadFormat, "{}: invalid JSON: the file is empty", config_path.string());
  }
  std::string chat_template;
  if (const auto template_path = dir / "chat_template.jinja"; std::filesystem::is_regular_file(template_path)) {
    chat_template = read_file(template_path);
  }
  return from_json_text(tokenizer_json, config_json, chat_template, dir.string());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids.insert(ids.end(), data_->special_prefix.begin(), data_->special_prefix.end());
  data_->encode(text, ids);
  if (add_special_tokens) ids.insert(ids.end(), data_->special_suffix.begin(), data_->special_suffix.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int32_t id : ids) {
    if (skip_special_tokens && data_->is_special(id)) continue;
    bytes.append(data_->bytes_of(id));
  }
  if (text::is_valid_utf8(bytes)) return bytes;
  return text::to_valid_utf8_lossy(bytes);
}

int64_t Tokenizer::vocab_size() const { return data_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = data_->added_token_ids.find(token); it != data_->added_token_ids.end()) return it->second;
  return data_->model.token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  const auto& added = data_->added_tokens;  // sorted by id
  const auto it = std::lower_bound(added.begin(), added.end(), id,
                                   [](const text::AddedToken& token, int32_t wanted) { return token.id < wanted; });
  if (it != added.end() && it->id == id) return it->content;
  const std::string* token = data_->model.id_to_token(id);
  return token != nullptr ? *token : std::string();
}

bool Tokenizer::is_special(int32_t id) const { return data_->is_special(id); }

std::string_view Tokenizer::token_bytes(int32_t id) const { return data_->bytes_of(id); }

std::optional<int32_t> Tokenizer::eos_token_id() const { return data_->eos_id; }
std::optional<int32_t> Tokenizer::bos_token_id() const { return data_->bos_id; }
bool Tokenizer::add_bos_token() const { return data_->add_bos_token; }
const std::string& Tokenizer::chat_template() const { return data_->chat_template; }

// ---------------------------------------------------------------------------------------------
// IncrementalDetokenizer

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDetokenizer::push(int32_t id) {
  if (skip_special_tokens_ && tokenizer_.is_special(id)) return {};
  pending_.append(tokenizer_.token_bytes(id));
  std::string out;
  const size_t consumed = text::append_complete_utf8(pending_, out);
  pending_.erase(0, consumed);
  return out;
}

std::string IncrementalDetokenizer::flush() {
  if (pending_.empty()) return {};
  pending_.clear();
  // What is left is a proper prefix of a well-formed sequence: one maximal subpart.
  return std::string(text::kReplacementCharacter);
}

}  // namespace metrale
