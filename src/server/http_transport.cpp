#include "server/http_transport.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <optional>
#include <thread>
#include <unordered_map>

#include <boost/asio.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"

namespace metrale::server {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;

namespace {

// Reads are at most this large; a pipelining client may queue this much beyond the request head
// limit while its current request is answered, then reading pauses until the response is out.
constexpr size_t kReadChunk = 16 << 10;
// After the last response of a connection the server stops sending and waits this long for the
// client to close, so that unread request bytes do not turn the close into a reset that could
// destroy the response in flight.
constexpr std::chrono::milliseconds kLinger{2000};
// Connections refused over the cap are answered by a canned 503; beyond this many such answers in
// flight, new ones are closed at once.
constexpr int64_t kMaxRejecting = 1024;
constexpr std::chrono::milliseconds kPumpInterval{1};
constexpr std::chrono::milliseconds kAcceptPause{50};

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

// An OpenAI-style error body for the errors the transport answers itself (fixed ASCII messages).
std::string error_json(int status, std::string_view message) {
  const char* type = status == 503 ? "service_unavailable" : "invalid_request_error";
  return fmt::format(R"({{"error":{{"message":"{}","type":"{}","param":null,"code":null}}}})", message, type);
}

std::string response_head(int status, int version, std::string_view content_type, const HttpHeaders& extra,
                          std::optional<size_t> content_length, bool chunked, bool keep_alive) {
  std::string head = fmt::format("HTTP/1.{} {} {}\r\n", version == 10 ? 0 : 1, status, http_reason(status));
  if (!content_type.empty()) head += fmt::format("Content-Type: {}\r\n", content_type);
  for (const auto& [name, value] : extra) head += fmt::format("{}: {}\r\n", name, value);
  if (content_length) head += fmt::format("Content-Length: {}\r\n", *content_length);
  if (chunked) head += "Transfer-Encoding: chunked\r\n";
  if (!keep_alive) head += "Connection: close\r\n";
  else if (version == 10) head += "Connection: keep-alive\r\n";
  head += "\r\n";
  return head;
}

}  // namespace

std::string_view http_reason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

std::string_view HttpRequest::header(std::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (iequals(key, name)) return value;
  }
  return {};
}

// What every connection shares: the limits, the handler and the counters.
struct TransportShared {
  TransportLimits limits;
  RequestHandler handler;
  ResponseObserver observer;
  std::atomic<int64_t> open{0};
  std::atomic<int64_t> rejecting{0};

  void observe(std::string_view path, int status) const {
    if (observer) observer(path, status);
  }
};

// One I/O thread's event loop: its connections and the pump steps of their exchanges.
// The io_context is declared after the containers so that it goes first: destroying it destroys
// the handlers that still own connections, whose destructors must not find the containers gone.
struct EventLoop {
  std::vector<std::function<bool()>> pumps;
  std::unordered_map<Connection*, std::weak_ptr<Connection>> connections;
  asio::io_context io{1};
  asio::steady_timer tick{io};
  bool ticking = false;
  bool stopped = false;

  void add_pump(std::function<bool()> step) {
    if (stopped) {
      step();  // the exchange is gone already: let it clean up
      return;
    }
    pumps.push_back(std::move(step));
    if (!ticking) schedule(kPumpInterval);
  }

  void schedule(Clock::duration delay) {
    ticking = true;
    tick.expires_after(delay);
    tick.async_wait([this](const error_code& ec) {
      if (ec) {
        ticking = false;
        return;
      }
      sweep();
    });
  }

  // Steps run in registration order; one that returns false (or throws) is dropped. The next sweep
  // comes after a millisecond, or three times what this one cost when that is more, so polling
  // never takes more than a quarter of the thread.
  void sweep() {
    const Clock::time_point start = Clock::now();
    std::vector<std::function<bool()>> current;
    current.swap(pumps);
    for (auto& step : current) {
      bool again = false;
      try {
        again = step();
      } catch (const std::exception& e) {
        METRALE_LOG_ERROR("http: a response step failed: {}", e.what());
      }
      if (again) pumps.push_back(std::move(step));
    }
    if (pumps.empty()) {
      ticking = false;
      return;
    }
    schedule(std::max<Clock::duration>(kPumpInterval, 3 * (Clock::now() - start)));
  }
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, EventLoop& loop, TransportShared& shared)
      : socket_(std::move(socket)), loop_(loop), shared_(shared), timer_(loop.io), write_timer_(loop.io) {}
  ~Connection() { shared_.open.fetch_sub(1); }

  void start() {
    loop_.connections.emplace(this, weak_from_this());
    error_code ignored;
    socket_.set_option(tcp::no_delay(true), ignored);
    begin_request();
  }

  // Closes the socket at once; an exchange in progress sees its client gone.
  void close_now() {
    if (state_ == State::kClosed) return;
    state_ = State::kClosed;
    failed_ = failed_ || exchange_ != nullptr;
    exchange_.reset();  // the exchange keeps this connection alive (gone) for as long as its handler holds it
    error_code ignored;
    timer_.cancel();
    write_timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    loop_.connections.erase(this);
  }

  bool gone() const { return failed_ || state_ == State::kClosed; }
  void observe(std::string_view path, int status) const { shared_.observe(path, status); }
  int version() const { return version_; }
  // Whether another request may follow this response: a half-closed client's pipelined requests
  // are still answered.
  bool keep_alive() const { return keep_alive_ && !close_after_ && !(peer_eof_ && buffer_.size() == 0); }
  void close_after() { close_after_ = true; }

  // Queues framed response bytes. Returns false once the client cannot be reached. More bytes
  // than max_buffered_output waiting for the client drop it, unless these end the response (a
  // large whole body may be followed by its last chunk).
  bool send(std::string_view bytes, bool ends_response = false) {
    if (gone()) return false;
    if (!ends_response && out_.size() + in_flight_.size() > shared_.limits.max_buffered_output) {
      METRALE_LOG_WARN("http: dropping a client that does not read ({} bytes waiting)", out_.size() + in_flight_.size());
      failed_ = true;
      close_now();
      return false;
    }
    out_.append(bytes);
    flush();
    return true;
  }

  // The current exchange has sent its whole response.
  void response_done() {
    response_complete_ = true;
    if (!writing_ && out_.empty()) after_response();
  }

 private:
  enum class State { kIdle, kReading, kHandling, kClosing, kClosed };

  void begin_request() {
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(std::min<size_t>(shared_.limits.max_header_bytes, UINT32_MAX)));
    parser_->body_limit(static_cast<uint64_t>(shared_.limits.max_body_bytes));
    parser_->eager(true);
    header_checked_ = false;
    if (buffer_.size() > 0) {
      start_reading();
      parse();
    } else if (peer_eof_) {
      finish();
    } else {
      state_ = State::kIdle;
      arm(timer_, shared_.limits.idle_timeout);
    }
    read_more();
  }

  void start_reading() {
    state_ = State::kReading;
    arm(timer_, shared_.limits.read_timeout);
  }

  void arm(asio::steady_timer& timer, std::chrono::milliseconds timeout) {
    timer.expires_after(timeout);
    timer.async_wait([self = shared_from_this(), &timer](const error_code& ec) {
      if (ec || timer.expiry() > Clock::now()) return;  // cancelled, or re-armed since
      self->on_timeout(&timer == &self->write_timer_);
    });
  }

  void on_timeout(bool write) {
    if (state_ == State::kClosed) return;
    if (write) {
      if (writing_) {
        failed_ = true;
        close_now();
      }
      return;
    }
    switch (state_) {
      case State::kIdle:
      case State::kClosing:
        close_now();
        break;
      case State::kReading:
        fail(408, fmt::format("the request did not arrive within {} s", shared_.limits.read_timeout.count() / 1000.0));
        break;
      default:
        break;
    }
  }

  // The one read loop: bytes go to buffer_ whatever the state, so that a client that resets the
  // connection while its response is prepared is noticed. While a request is handled, reading
  // pauses once the pipelined bytes reach the head limit.
  void read_more() {
    if (reading_ || state_ == State::kClosed || peer_eof_) return;
    if (state_ == State::kHandling && buffer_.size() >= shared_.limits.max_header_bytes + kReadChunk) return;
    reading_ = true;
    socket_.async_read_some(buffer_.prepare(kReadChunk), [self = shared_from_this()](const error_code& ec, size_t n) {
      self->on_read(ec, n);
    });
  }

  void on_read(const error_code& ec, size_t n) {
    reading_ = false;
    if (state_ == State::kClosed) return;
    if (ec == asio::error::eof) {
      on_peer_eof();
      return;
    }
    if (ec) {
      failed_ = true;
      close_now();
      return;
    }
    buffer_.commit(n);
    switch (state_) {
      case State::kIdle:
        start_reading();
        parse();
        break;
      case State::kReading:
        parse();
        break;
      case State::kClosing:
        buffer_.consume(buffer_.size());
        break;
      default:
        break;
    }
    read_more();
  }

  // The client sent FIN. Mid-request that is a broken request; while a response is prepared it is a
  // half-close, and the response is still due.
  void on_peer_eof() {
    peer_eof_ = true;
    switch (state_) {
      case State::kIdle:
      case State::kClosing:
        close_now();
        break;
      case State::kReading:
        fail(400, "the connection closed in the middle of the request");
        break;
      default:
        break;
    }
  }

  void parse() {
    for (;;) {
      error_code ec;
      size_t used = 0;
      if (buffer_.size() > 0) used = parser_->put(buffer_.data(), ec);
      else ec = http::error::need_more;
      buffer_.consume(used);
      if (ec && ec != http::error::need_more) {
        parse_failed(ec);
        return;
      }
      if (!header_checked_ && parser_->is_header_done()) {
        header_checked_ = true;
        if (!check_header()) return;
      }
      if (parser_->is_done()) {
        dispatch();
        return;
      }
      if (ec == http::error::need_more || used == 0) return;
    }
  }

  void parse_failed(const error_code& ec) {
    if (ec == http::error::bad_version && names_a_version()) {
      fail(505, "only HTTP/1.0 and HTTP/1.1 are served");
    } else if (ec == http::error::header_limit) {
      fail(431, fmt::format("the request head is larger than {} bytes", shared_.limits.max_header_bytes));
    } else if (ec == http::error::body_limit) {
      fail(413, fmt::format("the request body is larger than {} bytes", shared_.limits.max_body_bytes));
    } else {
      fail(400, fmt::format("the HTTP request is malformed ({})", ec.message()));
    }
  }

  // Whether the request line ends in a well-formed "HTTP/d.d" (then a bad version is 505, not 400).
  bool names_a_version() const {
    const std::string_view text(static_cast<const char*>(buffer_.data().data()), buffer_.size());
    const std::string_view line = text.substr(0, text.find("\r\n"));
    const size_t at = line.rfind(" HTTP/");
    if (at == std::string_view::npos || line.size() != at + 9) return false;
    const std::string_view version = line.substr(at + 6);
    return std::isdigit(static_cast<unsigned char>(version[0])) && version[1] == '.' &&
           std::isdigit(static_cast<unsigned char>(version[2]));
  }

  // Checks that need the head only, before the body is read.
  bool check_header() {
    const auto& message = parser_->get();
    if (message.version() != 10 && message.version() != 11) {
      fail(505, "only HTTP/1.0 and HTTP/1.1 are served");
      return false;
    }
    version_ = message.version();
    keep_alive_ = parser_->keep_alive();
    // Request bodies are framed by Content-Length or plain chunking; any other transfer coding
    // (gzip, or chunked not last) leaves the length unknowable or asks for decompression.
    const auto transfer = message[http::field::transfer_encoding];
    if (!transfer.empty() && !iequals(transfer, "chunked")) {
      fail(400, "the only transfer coding accepted on requests is chunked");
      return false;
    }
    const auto encoding = message[http::field::content_encoding];
    if (!encoding.empty() && !iequals(encoding, "identity")) {
      fail(415, "compressed request bodies are not accepted (send the body without Content-Encoding)");
      return false;
    }
    const auto expect = message[http::field::expect];
    if (!expect.empty()) {
      if (!iequals(expect, "100-continue")) {
        fail(417, "the only expectation served is 100-continue");
        return false;
      }
      if (version_ == 11 && !parser_->is_done()) send("HTTP/1.1 100 Continue\r\n\r\n");
    }
    return true;
  }

  void dispatch() {
    timer_.cancel();
    state_ = State::kHandling;
    auto message = parser_->release();
    parser_.reset();
    HttpRequest request;
    request.method = std::string(message.method_string());
    request.target = std::string(message.target());
    request.path = request.target.substr(0, request.target.find('?'));
    request.version = version_;
    for (const auto& field : message) request.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
    request.body = std::move(message.body());
    exchange_ = std::make_shared<Exchange>(shared_from_this(), loop_, std::move(request));
    const std::shared_ptr<Exchange> exchange = exchange_;
    try {
      shared_.handler(exchange);
    } catch (const std::exception& e) {
      METRALE_LOG_ERROR("http: the handler of {} failed: {}", exchange->request().path, e.what());
      if (!exchange->started()) exchange->respond(500, "application/json", error_json(500, "internal error"));
    }
    read_more();
  }

  // An error the transport answers itself; the connection closes after it.
  void fail(int status, std::string_view message) {
    timer_.cancel();
    state_ = State::kHandling;
    parser_.reset();
    close_after_ = true;
    buffer_.consume(buffer_.size());
    shared_.observe("", status);
    const std::string body = error_json(status, message);
    send(response_head(status, version_, "application/json", {}, body.size(), false, false) + body);
    response_done();
  }

  void flush() {
    if (writing_ || out_.empty() || state_ == State::kClosed) return;
    in_flight_.swap(out_);
    writing_ = true;
    arm(write_timer_, shared_.limits.write_timeout);
    asio::async_write(socket_, asio::buffer(in_flight_), [self = shared_from_this()](const error_code& ec, size_t) {
      self->on_write(ec);
    });
  }

  void on_write(const error_code& ec) {
    writing_ = false;
    write_timer_.cancel();
    if (state_ == State::kClosed) return;
    if (ec) {
      failed_ = true;
      close_now();
      return;
    }
    in_flight_.clear();
    if (!out_.empty()) {
      flush();
    } else if (response_complete_) {
      after_response();
    }
  }

  void after_response() {
    response_complete_ = false;
    exchange_.reset();  // breaks the cycle with the exchange, which holds this connection
    if (state_ == State::kClosed) return;
    if (!keep_alive()) {
      finish();
      return;
    }
    begin_request();
  }

  // Graceful close: no more sending, then wait (briefly) for the client to close.
  void finish() {
    if (state_ == State::kClosing || state_ == State::kClosed) return;
    if (peer_eof_) {
      close_now();
      return;
    }
    state_ = State::kClosing;
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    buffer_.consume(buffer_.size());
    arm(timer_, kLinger);
    read_more();
  }

  tcp::socket socket_;
  EventLoop& loop_;
  TransportShared& shared_;
  asio::steady_timer timer_;        // idle, read, linger deadlines
  asio::steady_timer write_timer_;  // a write in flight
  boost::beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  State state_ = State::kIdle;
  int version_ = 11;
  bool header_checked_ = false;
  bool reading_ = false;
  bool writing_ = false;
  bool peer_eof_ = false;
  bool keep_alive_ = true;
  bool close_after_ = false;
  bool failed_ = false;
  bool response_complete_ = false;
  std::string out_;        // framed bytes not yet handed to the socket
  std::string in_flight_;  // the bytes of the write in progress
  std::shared_ptr<Exchange> exchange_;
};

// ---------------------------------------------------------------------------------------------
// Exchange

Exchange::Exchange(std::shared_ptr<Connection> connection, EventLoop& loop, HttpRequest request)
    : connection_(std::move(connection)), loop_(loop), request_(std::move(request)), last_write_(Clock::now()) {}

Exchange::~Exchange() = default;

bool Exchange::client_gone() const {
  const std::shared_ptr<Connection>& connection = connection_;
  return connection == nullptr || connection->gone();
}

void Exchange::close_after_response() {
  connection_->close_after();
}

void Exchange::respond(int status, std::string_view content_type, std::string body, const HttpHeaders& extra) {
  if (started_) return;
  started_ = true;
  finished_ = true;
  const std::shared_ptr<Connection>& connection = connection_;
  if (connection == nullptr || connection->gone()) return;
  connection->observe(request_.path, status);
  const bool head_only = request_.method == "HEAD";
  std::string bytes = response_head(status, request_.version, content_type, extra, body.size(), false,
                                    connection->keep_alive());
  if (!head_only) bytes += body;
  connection->send(bytes, /*ends_response=*/true);
  last_write_ = Clock::now();
  connection->response_done();
}

void Exchange::begin_stream(int status, std::string_view content_type, const HttpHeaders& extra) {
  if (started_) return;
  started_ = true;
  streaming_ = true;
  const std::shared_ptr<Connection>& connection = connection_;
  if (connection == nullptr || connection->gone()) return;
  connection->observe(request_.path, status);
  chunked_ = request_.version == 11;
  if (!chunked_) connection->close_after();  // HTTP/1.0: the body ends with the connection
  connection->send(response_head(status, request_.version, content_type, extra, std::nullopt, chunked_,
                                 connection->keep_alive()));
  last_write_ = Clock::now();
}

bool Exchange::write(std::string_view data) {
  if (!streaming_ || finished_) return false;
  const std::shared_ptr<Connection>& connection = connection_;
  if (connection == nullptr || connection->gone()) return false;
  last_write_ = Clock::now();
  if (data.empty()) return true;
  if (!chunked_) return connection->send(data);
  std::string chunk = fmt::format("{:x}\r\n", data.size());
  chunk.append(data);
  chunk += "\r\n";
  return connection->send(chunk);
}

void Exchange::end_stream() {
  if (!streaming_ || finished_) return;
  finished_ = true;
  const std::shared_ptr<Connection>& connection = connection_;
  if (connection == nullptr || connection->gone()) return;
  if (chunked_) connection->send("0\r\n\r\n", /*ends_response=*/true);
  connection->response_done();
}

void Exchange::post(std::function<void()> task) { asio::post(loop_.io, std::move(task)); }

void Exchange::pump(std::function<bool()> step) { loop_.add_pump(std::move(step)); }

// ---------------------------------------------------------------------------------------------
// HttpTransport

namespace {

// A connection refused over the cap: it gets its 503 and is closed, reading nothing.
struct Rejected : std::enable_shared_from_this<Rejected> {
  Rejected(tcp::socket socket_in, TransportShared& shared_in, std::string response_in)
      : socket(std::move(socket_in)), shared(shared_in), timer(socket.get_executor()), response(std::move(response_in)) {}
  ~Rejected() {
    shared.rejecting.fetch_sub(1);
    shared.open.fetch_sub(1);
  }

  void start() {
    timer.expires_after(std::chrono::seconds(1));
    timer.async_wait([self = shared_from_this()](const error_code& ec) {
      if (ec) return;
      error_code ignored;
      self->socket.close(ignored);
    });
    asio::async_write(socket, asio::buffer(response), [self = shared_from_this()](const error_code& ec, size_t) {
      if (ec) return self->close();
      error_code ignored;
      self->socket.shutdown(tcp::socket::shutdown_send, ignored);
      self->drain();
    });
  }
  void drain() {
    socket.async_read_some(asio::buffer(scratch), [self = shared_from_this()](const error_code& ec, size_t) {
      if (ec) return self->close();
      self->drain();
    });
  }
  void close() {
    error_code ignored;
    timer.cancel();
    socket.close(ignored);
  }

  tcp::socket socket;
  TransportShared& shared;
  asio::steady_timer timer;
  std::string response;
  std::array<char, 4096> scratch{};
};

}  // namespace

struct HttpTransport::Impl {
  TransportShared shared;
  std::vector<std::unique_ptr<EventLoop>> loops;
  std::vector<asio::executor_work_guard<asio::io_context::executor_type>> guards;
  std::optional<tcp::acceptor> acceptor;  // on loops[0]
  asio::steady_timer accept_pause;
  size_t next_loop = 0;
  std::atomic<bool> stopped{false};

  explicit Impl(const TransportLimits& limits) : accept_pause(make_loops(limits)) {}

  asio::io_context& make_loops(const TransportLimits& limits) {
    const int threads = std::max(1, limits.io_threads);
    for (int i = 0; i < threads; ++i) {
      loops.push_back(std::make_unique<EventLoop>());
      guards.push_back(asio::make_work_guard(loops.back()->io));
    }
    return loops[0]->io;
  }

  void accept() {
    EventLoop& target = *loops[next_loop];
    next_loop = (next_loop + 1) % loops.size();
    acceptor->async_accept(target.io, [this, &target](const error_code& ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || stopped) return;
      if (ec) {
        // Out of descriptors (or memory): wait a moment instead of spinning on the error.
        const bool exhausted = ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space ||
                               ec == asio::error::no_memory || ec.value() == ENFILE;
        if (exhausted) {
          METRALE_LOG_WARN("http: cannot accept a connection: {}", ec.message());
          accept_pause.expires_after(kAcceptPause);
          accept_pause.async_wait([this](const error_code& wait_error) {
            if (!wait_error && !stopped) accept();
          });
          return;
        }
        accept();
        return;
      }
      const int64_t open = shared.open.fetch_add(1) + 1;
      if (open > shared.limits.max_connections) {
        asio::post(target.io, [this, socket = std::move(socket)]() mutable { reject(std::move(socket)); });
      } else {
        asio::post(target.io, [this, &target, socket = std::move(socket)]() mutable {
          std::make_shared<Connection>(std::move(socket), target, shared)->start();
        });
      }
      accept();
    });
  }

  // Over the connection cap: a canned 503, then close (after the client's FIN, or a second). The
  // socket still counts as open meanwhile.
  void reject(tcp::socket socket) {
    if (shared.rejecting.fetch_add(1) >= kMaxRejecting || stopped) {
      shared.rejecting.fetch_sub(1);
      shared.open.fetch_sub(1);
      return;
    }
    shared.observe("", 503);
    const std::string body = error_json(
        503, fmt::format("the server holds its maximum of {} connections; retry later", shared.limits.max_connections));
    std::make_shared<Rejected>(std::move(socket), shared,
                               response_head(503, 11, "application/json", {{"Retry-After", "1"}}, body.size(), false,
                                             false) +
                                   body)
        ->start();
  }

  // On each loop's thread: close the listener and the connections, let the pumps see it, stop.
  void stop_loop(EventLoop& loop, bool first) {
    if (first && acceptor) {
      error_code ignored;
      acceptor->close(ignored);
      accept_pause.cancel();
    }
    loop.stopped = true;
    std::vector<std::shared_ptr<Connection>> open;
    for (auto& [raw, weak] : loop.connections) {
      if (auto connection = weak.lock()) open.push_back(std::move(connection));
    }
    for (const auto& connection : open) connection->close_now();
    std::vector<std::function<bool()>> pumps;
    pumps.swap(loop.pumps);
    for (auto& step : pumps) {
      try {
        step();
      } catch (const std::exception& e) {
        METRALE_LOG_ERROR("http: a response step failed while stopping: {}", e.what());
      }
    }
    loop.tick.cancel();
    loop.io.stop();
  }
};

HttpTransport::HttpTransport(TransportLimits limits, RequestHandler handler, ResponseObserver observer)
    : limits_(limits), impl_(std::make_unique<Impl>(limits)) {
  impl_->shared.limits = limits;
  impl_->shared.handler = std::move(handler);
  impl_->shared.observer = std::move(observer);
}

HttpTransport::~HttpTransport() { stop(); }

int HttpTransport::bind(const std::string& host, int port, int backlog) {
  error_code ec;
  const asio::ip::address address = asio::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) raise(ErrorCode::kInvalidArgument, "--host {}: not an IP address", host);
  const tcp::endpoint endpoint(address, static_cast<uint16_t>(port));
  tcp::acceptor acceptor(impl_->loops[0]->io);
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(backlog, ec);
  if (ec) {
    raise(ErrorCode::kUnavailable, "cannot listen on {}:{}: {} (in use, or not an address of this machine?)", host,
          port, ec.message());
  }
  const int bound = acceptor.local_endpoint().port();
  impl_->acceptor.emplace(std::move(acceptor));
  return bound;
}

void HttpTransport::run() {
  METRALE_CHECK(impl_->acceptor.has_value(), "HttpTransport::run before bind");
  asio::post(impl_->loops[0]->io, [this] { impl_->accept(); });
  std::vector<std::thread> threads;
  for (size_t i = 1; i < impl_->loops.size(); ++i) {
    threads.emplace_back([loop = impl_->loops[i].get()] { loop->io.run(); });
  }
  impl_->loops[0]->io.run();
  for (auto& thread : threads) thread.join();
}

void HttpTransport::stop() {
  if (impl_->stopped.exchange(true)) return;
  for (size_t i = 0; i < impl_->loops.size(); ++i) {
    EventLoop& loop = *impl_->loops[i];
    asio::post(loop.io, [this, &loop, first = i == 0] { impl_->stop_loop(loop, first); });
  }
  impl_->guards.clear();
}

int64_t HttpTransport::open_connections() const { return impl_->shared.open.load(); }

}  // namespace metrale::server
