// The HTTP transport on loopback, driven by raw sockets so that every byte the client sends and
// receives is the test's: pipelining, keep-alive, HTTP/1.0 without chunking, half-closed clients,
// Expect: 100-continue, the limits (head, body, chunked body, no compressed bodies), the idle and
// read timeouts, the connection cap, a client that stops reading, and the pump.
#include "server/http_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

namespace metrale::server {
namespace {

using namespace std::chrono_literals;

// A blocking loopback client with a deadline on every read.
class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~RawClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }
  void send(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return;
      bytes.remove_prefix(static_cast<size_t>(n));
    }
  }
  void shutdown_write() { ::shutdown(fd_, SHUT_WR); }

  // Reads until the server closes, `until` appears, or the deadline passes.
  std::string read(std::chrono::milliseconds deadline = 5000ms, std::string_view until = {}) {
    const auto end = std::chrono::steady_clock::now() + deadline;
    while (std::chrono::steady_clock::now() < end) {
      if (!until.empty() && received_.find(until) != std::string::npos) break;
      pollfd entry{fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (::poll(&entry, 1, static_cast<int>(std::max<int64_t>(1, left.count()))) <= 0) continue;
      char buffer[65536];
      const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n <= 0) {
        closed_ = true;
        reset_ = n < 0;
        break;
      }
      received_.append(buffer, static_cast<size_t>(n));
    }
    return received_;
  }
  bool closed() const { return closed_; }
  bool reset() const { return reset_; }

 private:
  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
  bool reset_ = false;
  std::string received_;
};

size_t count(const std::string& text, std::string_view what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A transport on a free port, run by a thread, with test routes:
//   /echo       200, the body: "<method> <path> <body bytes>"
//   /stream     a streamed body of `chunks` pieces, one per pump tick
//   /flood      a streamed body that writes 1 MiB per tick until the client is gone
class Server {
 public:
  explicit Server(TransportLimits limits = {}) {
    transport_ = std::make_unique<HttpTransport>(
        limits, [this](const std::shared_ptr<Exchange>& exchange) { handle(exchange); },
        [this](std::string_view, int status) {
          if (status == 503) ++rejected;
        });
    port_ = transport_->bind("127.0.0.1", 0, 128);
    thread_ = std::thread([this] { transport_->run(); });
  }
  ~Server() {
    transport_->stop();
    thread_.join();
  }
  int port() const { return port_; }
  HttpTransport& transport() { return *transport_; }

  std::atomic<int> flood_gone{0};
  std::atomic<int> stopped_steps{0};
  std::atomic<int> rejected{0};

 private:
  void handle(const std::shared_ptr<Exchange>& exchange) {
    const HttpRequest& request = exchange->request();
    if (request.path == "/echo") {
      exchange->respond(200, "text/plain", request.method + " " + request.path + " " + std::to_string(request.body.size()));
    } else if (request.path == "/stream") {
      exchange->begin_stream(200, "text/plain");
      auto left = std::make_shared<int>(3);
      exchange->pump([exchange, left] {
        if (exchange->client_gone()) return false;
        exchange->write("piece" + std::to_string(*left) + ";");
        if (--*left > 0) return true;
        exchange->end_stream();
        return false;
      });
    } else if (request.path == "/flood") {
      exchange->begin_stream(200, "application/octet-stream");
      exchange->pump([this, exchange] {
        if (!exchange->write(std::string(1 << 20, 'x'))) {
          ++flood_gone;
          return false;
        }
        return true;
      });
    } else if (request.path == "/big") {
      // One large piece, as a non-streaming JSON body is written: it must arrive whole.
      exchange->begin_stream(200, "application/json");
      exchange->write(std::string(6 << 20, 'j'));
      exchange->end_stream();
    } else if (request.path == "/forever") {
      exchange->begin_stream(200, "text/plain");
      exchange->pump([this, exchange] {
        if (exchange->client_gone()) {
          ++stopped_steps;
          return false;
        }
        return true;
      });
    } else {
      exchange->respond(404, "text/plain", "no");
    }
  }

  std::unique_ptr<HttpTransport> transport_;
  int port_ = 0;
  std::thread thread_;
};

TEST(HttpTransport, KeepAliveAndPipelinedRequestsAnswerInOrder) {
  Server server;
  RawClient client(server.port());
  ASSERT_TRUE(client.connected());
  client.send("GET /echo HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
              "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string out = client.read(5000ms, "0\r\n\r\n");
  const size_t first = out.find("GET /echo 0");
  const size_t second = out.find("POST /echo 5");
  const size_t third = out.find("piece3;");
  ASSERT_NE(first, std::string::npos) << out;
  ASSERT_NE(second, std::string::npos) << out;
  ASSERT_NE(third, std::string::npos) << out;
  EXPECT_LT(first, second);
  EXPECT_LT(second, third);
  EXPECT_EQ(count(out, "HTTP/1.1 200 OK"), 3u);
  EXPECT_NE(out.find("Transfer-Encoding: chunked"), std::string::npos);
  EXPECT_FALSE(client.closed());  // keep-alive
}

TEST(HttpTransport, Http10GetsNoChunkingAndTheStreamEndsWithTheConnection) {
  Server server;
  RawClient whole(server.port());
  whole.send("GET /echo HTTP/1.0\r\n\r\n");
  const std::string answer = whole.read();
  EXPECT_EQ(answer.rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << answer;
  EXPECT_NE(answer.find("Content-Length: 11"), std::string::npos) << answer;
  EXPECT_TRUE(whole.closed());

  RawClient stream(server.port());
  stream.send("GET /stream HTTP/1.0\r\n\r\n");
  const std::string streamed = stream.read();
  EXPECT_EQ(streamed.find("chunked"), std::string::npos) << streamed;
  EXPECT_NE(streamed.find("\r\n\r\npiece3;piece2;piece1;"), std::string::npos) << streamed;
  EXPECT_TRUE(stream.closed());

  RawClient kept(server.port());
  kept.send("GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
  const std::string kept_answer = kept.read(1000ms, "GET /echo 0");
  EXPECT_NE(kept_answer.find("Connection: keep-alive"), std::string::npos) << kept_answer;
  kept.send("GET /echo HTTP/1.0\r\n\r\n");
  EXPECT_EQ(count(kept.read(), "HTTP/1.0 200 OK"), 2u);
}

TEST(HttpTransport, HalfClosedClientsGetTheirResponses) {
  Server server;
  RawClient client(server.port());
  client.send("GET /stream HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n");
  client.shutdown_write();
  const std::string out = client.read();
  EXPECT_NE(out.find("piece1;"), std::string::npos) << out;
  EXPECT_NE(out.find("GET /echo 0"), std::string::npos) << out;
  EXPECT_TRUE(client.closed());
  EXPECT_FALSE(client.reset());
}

TEST(HttpTransport, ExpectContinueIsAnswered) {
  Server server;
  RawClient client(server.port());
  client.send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n");
  EXPECT_NE(client.read(2000ms, "100 Continue\r\n\r\n").find("HTTP/1.1 100 Continue"), std::string::npos);
  client.send("abc");
  EXPECT_NE(client.read(2000ms, "POST /echo 3").find("POST /echo 3"), std::string::npos);
}

TEST(HttpTransport, LimitsOnHeadBodyAndEncoding) {
  TransportLimits limits;
  limits.max_header_bytes = 1024;
  limits.max_body_bytes = 4096;
  Server server(limits);
  const auto answer = [&](const std::string& request) {
    RawClient client(server.port());
    client.send(request);
    return client.read();
  };
  EXPECT_EQ(answer("GET /echo HTTP/1.1\r\nX-Big: " + std::string(4000, 'a') + "\r\n\r\n").rfind("HTTP/1.1 431", 0), 0u);
  EXPECT_EQ(answer("POST /echo HTTP/1.1\r\nContent-Length: 5000\r\n\r\n").rfind("HTTP/1.1 413", 0), 0u);
  // Chunked bodies count too: three chunks of 2000 bytes pass the limit on the third.
  std::string chunked = "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (int i = 0; i < 3; ++i) chunked += "7d0\r\n" + std::string(2000, 'b') + "\r\n";
  chunked += "0\r\n\r\n";
  const std::string too_big = answer(chunked);
  EXPECT_EQ(too_big.rfind("HTTP/1.1 413", 0), 0u) << too_big.substr(0, 200);
  EXPECT_NE(too_big.find("\"error\""), std::string::npos);
  std::string fits = "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n7d0\r\n" + std::string(2000, 'b') +
                     "\r\n0\r\n\r\n";
  EXPECT_NE(answer(fits + "GET /echo HTTP/1.1\r\nConnection: close\r\n\r\n").find("POST /echo 2000"), std::string::npos);
  EXPECT_EQ(answer("POST /echo HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc").rfind("HTTP/1.1 415", 0),
            0u);
  EXPECT_EQ(answer("GARBAGE\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  EXPECT_EQ(answer("GET /echo HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab").rfind("HTTP/1.1 400", 0),
            0u);
}

TEST(HttpTransport, IdleAndSlowClientsTimeOut) {
  TransportLimits limits;
  limits.idle_timeout = 300ms;
  limits.read_timeout = 300ms;
  Server server(limits);
  RawClient idle(server.port());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(idle.read(3000ms), "");
  EXPECT_TRUE(idle.closed());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2000ms);

  RawClient slow(server.port());
  slow.send("GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: ");  // the head never ends
  const std::string out = slow.read(3000ms);
  EXPECT_EQ(out.rfind("HTTP/1.1 408", 0), 0u) << out;
  EXPECT_TRUE(slow.closed());
}

TEST(HttpTransport, ConnectionsBeyondTheCapGet503) {
  TransportLimits limits;
  limits.max_connections = 2;
  Server server(limits);
  RawClient a(server.port());
  RawClient b(server.port());
  a.send("GET /echo HTTP/1.1\r\n\r\n");
  b.send("GET /echo HTTP/1.1\r\n\r\n");
  EXPECT_NE(a.read(2000ms, "GET /echo 0").find("200 OK"), std::string::npos);
  EXPECT_NE(b.read(2000ms, "GET /echo 0").find("200 OK"), std::string::npos);
  RawClient c(server.port());
  c.send("GET /echo HTTP/1.1\r\n\r\n");
  const std::string refused = c.read();
  EXPECT_EQ(refused.rfind("HTTP/1.1 503", 0), 0u) << refused;
  EXPECT_NE(refused.find("Retry-After"), std::string::npos);
  EXPECT_TRUE(c.closed());
  EXPECT_GE(server.rejected.load(), 1);
}

TEST(HttpTransport, AClientThatStopsReadingIsDropped) {
  TransportLimits limits;
  limits.max_buffered_output = 4 << 20;
  Server server(limits);
  RawClient client(server.port());
  client.send("GET /flood HTTP/1.1\r\n\r\n");  // and never read
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (server.flood_gone == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server.flood_gone.load(), 1);
}

TEST(HttpTransport, ALargeBodyWrittenAtOnceArrivesWhole) {
  TransportLimits limits;
  limits.max_buffered_output = 4 << 20;
  Server server(limits);
  RawClient client(server.port());
  client.send("GET /big HTTP/1.1\r\nConnection: close\r\n\r\n");
  const std::string out = client.read(10000ms);
  EXPECT_TRUE(client.closed());
  EXPECT_NE(out.find(std::string(6 << 20, 'j')), std::string::npos) << out.size() << " bytes arrived";
  EXPECT_NE(out.find("\r\n0\r\n\r\n"), std::string::npos);
}

TEST(HttpTransport, StopEndsEveryPumpWithItsClientGone) {
  auto server = std::make_unique<Server>();
  RawClient client(server->port());
  client.send("GET /forever HTTP/1.1\r\n\r\n");
  client.read(1000ms, "\r\n\r\n");
  std::atomic<int>* steps = &server->stopped_steps;
  EXPECT_EQ(steps->load(), 0);
  server->transport().stop();
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (steps->load() == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(steps->load(), 1);
  server.reset();
}

TEST(HttpTransport, ReasonPhrases) {
  EXPECT_EQ(http_reason(200), "OK");
  EXPECT_EQ(http_reason(431), "Request Header Fields Too Large");
  EXPECT_EQ(http_reason(503), "Service Unavailable");
}

}  // namespace
}  // namespace metrale::server
