// `metrale serve` on tiny random qwen4_exp and glm5_next directories (tests/common: PLE table in row
// shards; hub layout with its MTP layer), end to end over HTTP as a client sees it: the server starts
// from the directory, /health answers, and a token-id completion returns the greedy tokens that
// `metrale generate` gives for the same prompt (compared through the server's own /detokenize; the
// tiny vocabularies map to distinct ASCII tokens of the bundled tokenizer, so equal text means equal
// tokens), with n-gram and MTP speculation on the server too; and `metrale bench` measures them.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "apps/cli_helpers.h"
#include "common/tiny_glm5_checkpoint.h"
#include "common/tiny_qwen4_checkpoint.h"
#include "core/strings.h"
#include "core/test_support.h"

extern char** environ;

namespace metrale {
namespace {

using json = nlohmann::json;

struct HttpReply {
  int status = 0;  // 0: no connection or no status line
  std::string body;
};

// One HTTP/1.1 exchange with 127.0.0.1:port (Connection: close; a chunked body is decoded).
HttpReply http(int port, const std::string& method, const std::string& path, const std::string& body = {}) {
  HttpReply reply;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return reply;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    return reply;
  }
  const std::string request = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" +
                              "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                              "\r\n\r\n" + body;
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string raw;
  char buffer[4096];
  for (ssize_t n; (n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0;) raw.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  const size_t head_end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || head_end == std::string::npos) return reply;
  reply.status = std::stoi(raw.substr(9, 3));
  const std::string head = raw.substr(0, head_end);
  std::string payload = raw.substr(head_end + 4);
  std::string lower_head = head;
  for (char& c : lower_head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower_head.find("transfer-encoding: chunked") == std::string::npos) {
    reply.body = std::move(payload);
    return reply;
  }
  for (size_t at = 0;;) {
    const size_t line_end = payload.find("\r\n", at);
    if (line_end == std::string::npos) break;
    const size_t size = std::stoul(payload.substr(at, line_end - at), nullptr, 16);
    if (size == 0) break;
    reply.body.append(payload, line_end + 2, size);
    at = line_end + 2 + size + 2;
  }
  return reply;
}

// A port nothing listens on now (the kernel's choice for an ephemeral bind).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (fd < 0 || ::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

// `metrale serve <args>` as a child process, its output in a log file; stopped (SIGTERM, then
// SIGKILL after 10 s) and reaped on destruction.
class ServeProcess {
 public:
  explicit ServeProcess(std::vector<std::string> args)
      : log_(std::filesystem::temp_directory_path() / ("metrale_serve_" + std::to_string(::getpid()) + ".log")) {
    args.insert(args.begin(), {std::string(METRALE_BINARY_DIR) + "/bin/metrale", "serve"});
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    if (posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
  }
  ~ServeProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      for (int i = 0; i < 100 && !exited(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (!exited()) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
      }
    }
    std::filesystem::remove(log_);
  }
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;

  bool started() const { return pid_ > 0; }
  std::string log() const { return read_file(log_); }

  // Polls GET /health until it answers 200 (true), the process exits or `limit` passes (false).
  bool wait_ready(int port, std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      if (exited()) return false;
      if (http(port, "GET", "/health").status == 200) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return false;
  }

 private:
  bool exited() {
    if (reaped_) return true;
    int status = 0;
    reaped_ = ::waitpid(pid_, &status, WNOHANG) == pid_;
    return reaped_;
  }

  std::filesystem::path log_;
  pid_t pid_ = -1;
  bool reaped_ = false;
};

// Greedy tokens of `metrale generate` and of a `metrale serve` completion for the same prompt.
void check_serves_like_generate(const std::filesystem::path& model, const std::string& prompt_ids,
                                const std::vector<std::string>& serve_flags) {
  const std::filesystem::path tokenizer_dir = std::filesystem::path(METRALE_SOURCE_DIR) / "models" / "default";
  ASSERT_TRUE(std::filesystem::exists(tokenizer_dir / "tokenizer.json"))
      << tokenizer_dir << " has no tokenizer.json: run scripts/install-deps.sh";
  constexpr int kTokens = 12;
  const auto generated =
      testing::run_metrale("generate --model " + model.string() + " --device cpu --prompt-ids " + prompt_ids +
                           " --max-tokens " + std::to_string(kTokens) + " --temperature 0 --ignore-eos --json");
  ASSERT_EQ(generated.exit_code, 0) << generated.err;
  const json tokens = json::parse(generated.out).at("token_ids");
  ASSERT_EQ(tokens.size(), static_cast<size_t>(kTokens));

  const int port = free_port();
  ASSERT_GT(port, 0);
  std::vector<std::string> args = {"--model", model.string(), "--tokenizer", tokenizer_dir.string(), "--device", "cpu",
                                   "--host",  "127.0.0.1",    "--port",      std::to_string(port)};
  args.insert(args.end(), serve_flags.begin(), serve_flags.end());
  ServeProcess server(args);
  ASSERT_TRUE(server.started());
  ASSERT_TRUE(server.wait_ready(port, std::chrono::seconds(120))) << "the server did not become ready:\n"
                                                                  << server.log();

  json prompt = json::array();
  for (const std::string& id : split(prompt_ids, ',')) prompt.push_back(std::stoi(id));
  const HttpReply completion =
      http(port, "POST", "/v1/completions",
           json{{"prompt", prompt}, {"max_tokens", kTokens}, {"temperature", 0}, {"ignore_eos", true}}.dump());
  ASSERT_EQ(completion.status, 200) << completion.body << "\n" << server.log();
  const json body = json::parse(completion.body);
  EXPECT_EQ(body.at("usage").at("completion_tokens"), kTokens);
  EXPECT_EQ(body.at("choices").at(0).at("finish_reason"), "length");
  const HttpReply detokenized = http(port, "POST", "/detokenize", json{{"tokens", tokens}}.dump());
  ASSERT_EQ(detokenized.status, 200) << detokenized.body;
  const std::string text = body.at("choices").at(0).at("text");
  EXPECT_FALSE(text.empty());
  EXPECT_EQ(text, json::parse(detokenized.body).at("prompt").get<std::string>()) << "generate gave " << tokens.dump();
  EXPECT_EQ(http(port, "GET", "/health").status, 200);
}

TEST(ServeHybrid, Qwen4ExpDirectoryServesItsGreedyTokens) {
  const testing::Qwen4Spec spec;
  testing::TempDir dir;
  testing::write_qwen4_checkpoint(dir.path(), spec, testing::make_qwen4_weights(spec, 3));
  check_serves_like_generate(dir.path(), "5,6,7,2,9,10,11,5,6,7,5,6", {});
  check_serves_like_generate(dir.path(), "5,6,7,2,9,10,11,5,6,7,5,6",
                             {"--speculative-method", "ngram", "--num-drafts", "3"});
}

TEST(ServeHybrid, Glm5NextDirectoryServesItsGreedyTokens) {
  testing::TempDir dir;
  const testing::TinyGlm5Spec spec;
  testing::write_glm5_checkpoint(dir.path(), spec, testing::make_glm5_weights(spec, 61),
                                 {testing::Glm5Layout::kHub, "model.language_model.", DType::kBF16});
  check_serves_like_generate(dir.path(), "5,6,7,8,5,6,7,8,5,6,7,8,9,10,11,12", {});
  check_serves_like_generate(dir.path(), "5,6,7,8,5,6,7,8,5,6,7,8,9,10,11,12",
                             {"--speculative-method", "mtp", "--num-drafts", "2"});
}

// `metrale bench --model DIR` on the same directories: decode and prefill rows with their times.
void check_bench(const std::filesystem::path& model) {
  const auto result =
      testing::run_metrale("bench --model " + model.string() +
                           " --device cpu --batch 1,2 --context 24 --prefill 16 --iters 1 --warmup 0 --json");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const json report = json::parse(result.out);
  std::vector<std::string> phases;
  for (const json& row : report.at("results")) {
    phases.push_back(row.at("phase"));
    EXPECT_GT(row.at("step_ms").get<double>(), 0.0) << row.dump();
  }
  EXPECT_EQ(phases, (std::vector<std::string>{"decode", "decode", "prefill"})) << result.out;
  for (const json& row : report.at("results")) EXPECT_FALSE(row.contains("sampled_step_ms")) << row.dump();
  // --sampled: decode rows also timed with their tokens sampled (top-k, top-p) by the engine's sampler.
  const auto sampled = testing::run_metrale("bench --model " + model.string() +
                                            " --device cpu --batch 2 --context 24 --prefill 16 --iters 1 --warmup 0 "
                                            "--sampled --json");
  ASSERT_EQ(sampled.exit_code, 0) << sampled.err;
  const json sampled_report = json::parse(sampled.out);  // alive for the loop (at() returns into it)
  for (const json& row : sampled_report.at("results")) {
    if (row.at("phase") == "decode") {
      EXPECT_GT(row.value("sampled_step_ms", 0.0), 0.0) << row.dump();
    } else {
      EXPECT_FALSE(row.contains("sampled_step_ms")) << row.dump();
    }
  }
}

TEST(ServeHybrid, BenchMeasuresQwen4ExpAndGlm5NextDirectories) {
  testing::TempDir qwen4_dir, glm5_dir;
  const testing::Qwen4Spec qwen4;
  testing::write_qwen4_checkpoint(qwen4_dir.path(), qwen4, testing::make_qwen4_weights(qwen4, 3));
  check_bench(qwen4_dir.path());
  const testing::TinyGlm5Spec glm5;
  testing::write_glm5_checkpoint(glm5_dir.path(), glm5, testing::make_glm5_weights(glm5, 61),
                                 {testing::Glm5Layout::kHub, "model.language_model.", DType::kBF16});
  check_bench(glm5_dir.path());
}

}  // namespace
}  // namespace metrale
