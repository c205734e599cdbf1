// The HTTP/1.1 transport of the server: an event-driven connection handler on Boost.Asio, with
// Boost.Beast's request parser. A few I/O threads, each running its own event loop, hold every
// connection (idle keep-alive ones, ones reading a request, ones streaming a response) without a
// thread each; the handler above it (server/http_server.h) sees one Exchange per request.
//
// What a client cannot do to it:
// - exhaust memory: the request head is at most `max_header_bytes`, the body (chunked included) at
//   most `max_body_bytes` (413), request bodies are never decompressed (Content-Encoding other than
//   identity is 415), and a client that stops reading a response is dropped once
//   `max_buffered_output` bytes wait for it;
// - exhaust connections: beyond `max_connections` a new connection gets a 503 and is closed; a
//   keep-alive connection idle for `idle_timeout` is closed, and a request whose head and body do
//   not arrive within `read_timeout` of its first byte gets 408 (slow-header clients);
// - confuse framing: pipelined requests are answered one by one, in order; HTTP/1.0 clients get
//   no chunked encoding (a streamed body ends when the connection closes); a client that half-closes
//   after its request still gets the response; `Expect: 100-continue` is answered.
//
// Threads: every Exchange and connection belongs to one I/O thread, and its methods must be called
// there; Exchange::post() runs a task on it from any thread. Exchange::pump() registers a step that
// the loop calls about every millisecond until it returns false: the server polls its engine
// streams there (the engine thread never waits for the network).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace metrale::server {

struct TransportLimits {
  size_t max_header_bytes = size_t{32} << 10;  // request line + headers; beyond: 431
  size_t max_body_bytes = size_t{32} << 20;    // decoded body, chunked or not; beyond: 413
  int max_connections = 10000;                 // open connections; beyond: 503 and close
  std::chrono::milliseconds idle_timeout{60'000};   // a keep-alive connection waiting for a request
  std::chrono::milliseconds read_timeout{30'000};   // a request's head and body, from its first byte: 408
  std::chrono::milliseconds write_timeout{60'000};  // a response write that makes no progress
  size_t max_buffered_output = size_t{8} << 20;     // response bytes waiting for a slow reader
  int io_threads = 2;
};

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;  // as sent: "GET", "POST", ...
  std::string target;  // the request target as sent
  std::string path;    // the target without its query
  int version = 11;    // 10 or 11
  HttpHeaders headers;
  std::string body;

  // The value of the first header of that name (case-insensitive); "" when absent.
  std::string_view header(std::string_view name) const;
};

class Connection;
struct EventLoop;

// While a response has nothing to send, its handler writes a heartbeat this often (an SSE comment,
// or JSON's insignificant leading whitespace): a write is the only reliable way to learn that a
// client is gone (a FIN may be a half-close whose answer is still due; the second write after the
// peer closed fails), so the requests of departed clients are cancelled within about two intervals.
inline constexpr std::chrono::milliseconds kHeartbeatInterval{250};

// One request and its response. Created by the transport for every complete request; the handler
// keeps it (shared) for as long as the response takes.
class Exchange : public std::enable_shared_from_this<Exchange> {
 public:
  Exchange(std::shared_ptr<Connection> connection, EventLoop& loop, HttpRequest request);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  const HttpRequest& request() const { return request_; }

  // A whole response (Content-Length). `body` is omitted for HEAD requests.
  void respond(int status, std::string_view content_type, std::string body, const HttpHeaders& extra = {});
  // A response whose body follows in pieces: chunked on HTTP/1.1; on HTTP/1.0 without framing, and
  // the connection closes after it.
  void begin_stream(int status, std::string_view content_type, const HttpHeaders& extra = {});
  // Appends to a streamed body. Returns false once the client is gone (the connection failed, or
  // more than max_buffered_output bytes wait for it); nothing more will reach it.
  bool write(std::string_view data);
  void end_stream();

  // The connection failed or closed: the response can no longer be delivered.
  bool client_gone() const;
  bool started() const { return started_; }
  // When the response last wrote to the client (heartbeats are due kHeartbeatInterval after it).
  std::chrono::steady_clock::time_point last_write() const { return last_write_; }
  // Close the connection once this response is complete (shutdown: no more requests on it).
  void close_after_response();

  // Runs `task` on this exchange's I/O thread (from any thread; after the transport stopped, never).
  void post(std::function<void()> task);
  // Calls `step` on the I/O thread about every millisecond until it returns false. The step is
  // called once more with client_gone() true when the transport stops, so it can clean up.
  void pump(std::function<bool()> step);

 private:
  friend class Connection;
  // Held while the exchange lives (a half-closed client's connection has no read in flight to keep
  // it): the connection drops its own reference to the exchange when the response is over.
  std::shared_ptr<Connection> connection_;
  EventLoop& loop_;
  HttpRequest request_;
  bool started_ = false;
  bool finished_ = false;
  bool streaming_ = false;
  bool chunked_ = false;
  std::chrono::steady_clock::time_point last_write_;
};

// Called on an I/O thread for every complete request.
using RequestHandler = std::function<void(const std::shared_ptr<Exchange>&)>;
// Called for every response status sent (routes: the request path; "" for errors the transport
// answers itself: malformed requests, limits, timeouts, the connection cap).
using ResponseObserver = std::function<void(std::string_view path, int status)>;

class HttpTransport {
 public:
  HttpTransport(TransportLimits limits, RequestHandler handler, ResponseObserver observer = {});
  ~HttpTransport();
  HttpTransport(const HttpTransport&) = delete;
  HttpTransport& operator=(const HttpTransport&) = delete;

  // Binds and listens; returns the port (0 picks a free one). Throws kInvalidArgument for an
  // address that is not one, kUnavailable when it cannot be bound.
  int bind(const std::string& host, int port, int backlog);
  // Runs the I/O threads until stop(); the calling thread is one of them.
  void run();
  // From any thread: closes the listener and every connection, and makes run() return. The pump
  // steps are called a last time (their exchanges gone). Idempotent.
  void stop();

  const TransportLimits& limits() const { return limits_; }
  int64_t open_connections() const;

 private:
  struct Impl;
  TransportLimits limits_;
  std::unique_ptr<Impl> impl_;
};

// "200 OK" and friends: the reason phrase of a status.
std::string_view http_reason(int status);

}  // namespace metrale::server
