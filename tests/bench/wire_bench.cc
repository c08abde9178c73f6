// Activation bytes/s through Forward: unary, chunked and shared memory, per wire dtype, next to
// raw loopback TCP and this machine's memcpy measured in the same run. Prints a table and writes
// JSON; not a test (nothing here is timed against a threshold).
//
// The server is the real service on 127.0.0.1 in this process (its own gRPC threads and device
// executor); the module is a Linear with a narrow output (in 1024, out 8), so the response is
// small and the request dominates. Each row reports the end-to-end rate and the rate with the
// server's own time (decode + compute + encode, `server_seconds`) taken out.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/rpc_method.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "gradwire/client/client.h"
#include "gradwire/client/shared_memory.h"
#include "gradwire/wire/chunking.h"
#include "gradwire/wire/tensor.h"
#include "gradwire/wire/zero_copy.h"
#include "server/core/heap_trim.h"
#include "server/server.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Raw loopback TCP: one connection; each round sends `bytes` and waits for a one-byte answer
// (the same request/acknowledge shape as a Forward). Returns seconds per round, median.
double TcpSeconds(int64_t bytes, int rounds) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      listen(listener, 1) != 0) {
    throw std::runtime_error("loopback TCP listener failed");
  }
  socklen_t len = sizeof addr;
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  std::thread receiver([&] {
    const int fd = accept(listener, nullptr, nullptr);
    std::vector<char> buf(1 << 20);
    for (int r = 0; r < rounds; ++r) {
      int64_t got = 0;
      while (got < bytes) {
        const ssize_t n = read(fd, buf.data(), size_t(std::min<int64_t>(buf.size(), bytes - got)));
        if (n <= 0) break;
        got += n;
      }
      const char ack = 1;
      (void)!write(fd, &ack, 1);
    }
    close(fd);
  });
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw std::runtime_error("loopback TCP connect failed");
  }
  std::vector<char> payload(size_t(std::min<int64_t>(bytes, 4 << 20)));
  std::mt19937 rng(1);
  for (char& c : payload) c = char(rng());
  std::vector<double> times;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = Clock::now();
    int64_t sent = 0;
    while (sent < bytes) {
      const ssize_t n =
          write(fd, payload.data(), size_t(std::min<int64_t>(payload.size(), bytes - sent)));
      if (n <= 0) throw std::runtime_error("loopback TCP write failed");
      sent += n;
    }
    char ack;
    if (read(fd, &ack, 1) != 1) throw std::runtime_error("loopback TCP ack failed");
    times.push_back(Since(t0));
  }
  close(fd);
  receiver.join();
  close(listener);
  return Median(times);
}

// memcpy between two buffers of `bytes` already touched: the most a shared-memory path that copies
// once can move. Seconds per copy, median.
double MemcpySeconds(std::vector<char>& from, std::vector<char>& to, int64_t bytes, int rounds) {
  std::vector<double> times;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = Clock::now();
    std::memcpy(to.data(), from.data(), size_t(bytes));
    times.push_back(Since(t0));
  }
  volatile char sink = to[size_t(bytes - 1)];
  (void)sink;
  return Median(times);
}

struct Row {
  std::string path;  // tcp | memcpy | unary | zero-copy | chunked | shm
  std::string dtype;
  int64_t bytes = 0;          // request tensor bytes
  double seconds = 0;         // median end-to-end per request
  double server_seconds = 0;  // median server time per request
  // Median over requests of (end-to-end - server time): the wire's share, taken request by
  // request (a difference of the two medians drowns in the compute's spread when it dominates).
  double wire_seconds = 0;
  double gib_s() const { return seconds > 0 ? double(bytes) / seconds / (1 << 30) : 0; }
  double wire_gib_s() const {
    return wire_seconds > 0 ? double(bytes) / wire_seconds / (1 << 30) : 0;
  }
};

std::string Human(int64_t bytes) {
  char buf[32];
  if (bytes >= (1 << 20)) {
    std::snprintf(buf, sizeof buf, "%lld MiB", (long long)(bytes >> 20));
  } else {
    std::snprintf(buf, sizeof buf, "%lld KiB", (long long)(bytes >> 10));
  }
  return buf;
}

// Micro-measurements of the copies the wire path avoids: an F32 request read as a view over the
// received bytes vs copied out of them, and chunks written in place vs collected then joined.
struct CopyFigures {
  int64_t bytes = 0;
  double view_s = 0, copy_s = 0, in_place_s = 0, join_s = 0;
};

CopyFigures MeasureCopies(int64_t bytes, int rounds) {
  using namespace gradwire;
  CopyFigures f;
  f.bytes = bytes;
  v1::Tensor t;
  t.set_dtype(v1::F32);
  t.add_shape(bytes / 4 / 1024);
  t.add_shape(1024);
  t.mutable_data()->resize(size_t(bytes));
  std::mt19937 rng(2);
  for (char& c : *t.mutable_data()) c = char(rng() & 0x3f);  // finite floats
  std::vector<double> view, copy, in_place, join;
  const int64_t chunk = 4 << 20;
  // What the server does with a request's F32 input: a checked view, which the CPU backend
  // borrows without a copy.
  const device::BackendPtr backend = device::MakeCpuBackend();
  auto decode = [&](const v1::Tensor& m) {
    const wire::TensorView v = *wire::ViewOf(m, "input");
    return backend->FromWire(v, v.shape[0], v.shape[1], nullptr, {});
  };
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    at::Tensor v = decode(t);
    volatile float sink = v.data_ptr<float>()[0];
    view.push_back(Since(t0));
    t0 = Clock::now();
    std::string copied(t.data());  // what reading without a view costs on top
    at::Tensor c = decode(t);
    sink = c.data_ptr<float>()[1] + float(copied[0]);
    copy.push_back(Since(t0));
    (void)sink;
    // Chunks: in place (the assembler) vs collected and joined.
    v1::Tensor header = t;
    header.clear_data();
    v1::ForwardRequest req;
    *req.mutable_input() = header;
    wire::ChunkAssembler a;
    t0 = Clock::now();
    (void)a.Start(wire::Slots(req), int64_t(1) << 40, "limit", chunk);
    v1::TensorChunk piece;
    for (int64_t off = 0; off < bytes; off += chunk) {
      piece.set_tensor(0);
      piece.set_offset(uint64_t(off));
      piece.set_data(t.data().data() + off, size_t(std::min(chunk, bytes - off)));
      (void)a.Add(piece);
    }
    in_place.push_back(Since(t0));
    t0 = Clock::now();
    std::vector<std::string> pieces;
    for (int64_t off = 0; off < bytes; off += chunk) {
      pieces.emplace_back(t.data().data() + off, size_t(std::min(chunk, bytes - off)));
    }
    std::string joined;
    for (const std::string& p : pieces) joined += p;
    join.push_back(Since(t0));
  }
  f.view_s = Median(view);
  f.copy_s = Median(copy);
  f.in_place_s = Median(in_place);
  f.join_s = Median(join);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace gradwire;
  CLI::App app(
      "gradwire wire benchmark: activation bytes/s through Forward, unary, chunked and shared "
      "memory, per wire dtype, next to raw loopback TCP and memcpy");
  int64_t min_kib = 64, max_mib = 256;
  double seconds_per_point = 1.0;
  std::string json_path;
  std::vector<std::string> dtypes = {"f32", "bf16", "fp8"};
  app.add_option("--min-kib", min_kib, "smallest request, KiB")->capture_default_str();
  app.add_option("--max-mib", max_mib, "largest request, MiB")->capture_default_str();
  app.add_option("--seconds", seconds_per_point,
                 "time to spend on each point (at least 3 requests)")
      ->capture_default_str();
  app.add_option("--dtypes", dtypes, "wire dtypes: f32 bf16 f16 fp8")->capture_default_str();
  app.add_option("--json", json_path, "write the results as JSON to this file");
  int frame_kib = 0;
  app.add_option("--http2-frame-kib", frame_kib,
                 "HTTP/2 max frame size both ends announce, KiB (0: gRPC's default, 16)")
      ->check(CLI::Range(0, 16383));
  int window_mib = 0;
  app.add_option("--http2-window-mib", window_mib,
                 "HTTP/2 initial stream window both ends announce, MiB (0: gRPC's default, "
                 "which BDP probing then grows)")
      ->check(CLI::Range(0, 1024));
  std::vector<std::string> extra_args;
  app.add_option("--channel-arg", extra_args,
                 "NAME=INT: any further gRPC channel argument, on both ends (e.g. "
                 "grpc.experimental.tcp_min_read_chunk_size=1048576)");
  bool tcp_zerocopy = false;
  app.add_flag("--tcp-zerocopy", tcp_zerocopy,
               "gRPC's TCP zero-copy send (MSG_ZEROCOPY) on both ends");
  std::vector<std::string> paths = {"unary", "zero-copy", "chunked", "shm"};
  app.add_option("--paths", paths, "paths: unary zero-copy chunked shm")->capture_default_str();
  bool heap_retain = true;
  app.add_option("--heap-retain", heap_retain,
                 "the server's default heap policy for the whole process (core/heap_trim.h); "
                 "false: the C library's defaults (to compare allocators)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (heap_retain) core::RetainLargeBlocks();

  // The server: the real service, limits large enough for a 256 MiB unary request.
  const int max_message_mib = int(std::max<int64_t>(64, max_mib * 2 + 16));
  server::ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.backend = device::MakeCpuBackend();
  options.heap_trim_every_s = 0;
  options.max_message_mib = max_message_mib;
  options.service.version = "bench";
  options.service.chunk_bytes = 4 << 20;
  options.service.max_stream_bytes = int64_t(max_mib + 16) << 20;
  // No request limits: the benchmark sends what it measures.
  options.service.limits.max_request_bytes = 0;
  options.service.limits.max_tensor_elements = 0;
  options.service.shared_memory.enabled = true;
  if (frame_kib > 0)
    options.channel_args.emplace_back(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, frame_kib << 10);
  if (tcp_zerocopy) options.channel_args.emplace_back(GRPC_ARG_TCP_TX_ZEROCOPY_ENABLED, 1);
  std::vector<std::pair<std::string, int>> extra;
  for (const std::string& a : extra_args) {
    const size_t eq = a.find('=');
    if (eq == std::string::npos) {
      std::fprintf(stderr, "wire_bench: --channel-arg %s: want NAME=INT\n", a.c_str());
      return 2;
    }
    extra.emplace_back(a.substr(0, eq), std::stoi(a.substr(eq + 1)));
    options.channel_args.push_back(extra.back());
  }
  if (window_mib > 0) {
    options.channel_args.emplace_back(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, window_mib << 20);
  }
  auto started = server::Server::Start(std::move(options));
  if (!started.ok()) {
    std::fprintf(stderr, "wire_bench: cannot start the server: %s\n",
                 std::string(started.status().message()).c_str());
    return 1;
  }
  std::unique_ptr<server::Server> server = *std::move(started);
  const int port = server->port();

  auto make_client = [&](client::ClientOptions::Chunking chunking, client::WireDType dtype) {
    client::ClientOptions o;
    o.server = "127.0.0.1:" + std::to_string(port);
    o.timeout = std::chrono::seconds(600);
    o.max_message_mib = max_message_mib;
    o.chunking = chunking;
    o.wire_dtype = dtype;
    return std::make_unique<client::Client>(o);
  };
  constexpr int64_t kIn = 1024, kOut = 8;
  std::string module_id;
  {
    auto c = make_client(client::ClientOptions::Chunking::kNever, client::WireDType::kF32);
    v1::ModuleSpec spec;
    spec.set_kind(v1::LINEAR);
    spec.set_in_features(kIn);
    spec.set_out_features(kOut);
    spec.set_seed(1);
    auto info = c->CreateModule(spec);
    if (!info.ok()) {
      std::fprintf(stderr, "wire_bench: %s\n", std::string(info.status().message()).c_str());
      return 1;
    }
    module_id = info->module_id();
  }

  std::vector<int64_t> sizes;
  for (int64_t b = min_kib << 10; b <= (max_mib << 20); b *= 4) sizes.push_back(b);
  // Shared memory: one region holds the largest request, its output after it.
  const int64_t max_bytes = sizes.empty() ? 0 : sizes.back();
  const int64_t output_at = max_bytes + 4096;
  auto region = client::SharedMemoryBuffer::Create(client::SharedMemoryBuffer::UniqueKey(),
                                                   size_t(output_at + max_bytes / 64 + 4096));
  if (!region.ok()) {
    std::fprintf(stderr, "wire_bench: %s\n", std::string(region.status().message()).c_str());
    return 1;
  }
  {
    auto c = make_client(client::ClientOptions::Chunking::kNever, client::WireDType::kF32);
    if (auto st = c->RegisterSharedMemory("bench", (*region)->key(), 0, (*region)->size());
        !st.ok()) {
      std::fprintf(stderr, "wire_bench: %s\n", std::string(st.message()).c_str());
      return 1;
    }
  }
  std::vector<char> copy_from(size_t(max_bytes), 1), copy_to(size_t(max_bytes), 2);
  struct DType {
    std::string name;
    client::WireDType wire;
    int64_t element;
  };
  std::vector<DType> all = {{"f32", client::WireDType::kF32, 4},
                            {"bf16", client::WireDType::kBF16, 2},
                            {"f16", client::WireDType::kF16, 2},
                            {"fp8", client::WireDType::kFp8E4M3, 1}};
  std::vector<Row> rows;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const int total_points = int(sizes.size() * (2 + paths.size() * dtypes.size()));
  int point = 0;
  auto progress = [&](const std::string& what) {
    ++point;
    std::fprintf(stderr, "\r[%d/%d] %-40s", point, total_points, what.c_str());
    std::fflush(stderr);
  };

  for (int64_t bytes : sizes) {
    // Raw TCP first, then every dtype and path at this size.
    progress("tcp " + Human(bytes));
    const int tcp_rounds =
        int(std::clamp<double>(seconds_per_point * (2e9 / double(bytes)), 3, 200));
    Row tcp{"tcp", "-", bytes, TcpSeconds(bytes, tcp_rounds), 0};
    rows.push_back(tcp);
    progress("memcpy " + Human(bytes));
    rows.push_back({"memcpy", "-", bytes, MemcpySeconds(copy_from, copy_to, bytes, tcp_rounds), 0});
    for (const std::string& name : dtypes) {
      auto it =
          std::find_if(all.begin(), all.end(), [&](const DType& d) { return d.name == name; });
      if (it == all.end()) {
        std::fprintf(stderr, "wire_bench: unknown dtype %s\n", name.c_str());
        return 2;
      }
      const int64_t row_count = std::max<int64_t>(1, bytes / (kIn * it->element));
      client::HostTensor x = client::HostTensor::Zeros({row_count, kIn});
      for (float& v : x.data) v = normal(rng);
      for (const std::string& path : paths) {
        const bool chunked = path == "chunked", shm = path == "shm",
                   zero_copy = path == "zero-copy";
        progress(path + " " + name + " " + Human(bytes));
        grpc::ChannelArguments args;
        args.SetMaxReceiveMessageSize(max_message_mib << 20);
        args.SetMaxSendMessageSize(max_message_mib << 20);
        if (frame_kib > 0) args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, frame_kib << 10);
        if (tcp_zerocopy) args.SetInt(GRPC_ARG_TCP_TX_ZEROCOPY_ENABLED, 1);
        if (window_mib > 0) args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, window_mib << 20);
        for (const auto& [name, value] : extra) args.SetInt(name, value);
        auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                                 grpc::InsecureChannelCredentials(), args);
        auto stub = v1::Gradwire::NewStub(channel);
        const grpc::internal::RpcMethod forward_method("/gradwire.v1.Gradwire/Forward",
                                                       grpc::internal::RpcMethod::NORMAL_RPC);
        // Raw stub calls so the payload is encoded once, outside the timing, as a client
        // streaming activations it already holds on the wire would.
        v1::ForwardRequest req;
        req.set_module_id(module_id);
        *req.mutable_input() = client::ToWire(x, it->wire);
        req.set_output_dtype(client::ToProto(it->wire));
        const int64_t request_bytes = int64_t(req.input().data().size());
        if (shm) {
          // The client writes its tensor into the region once, as it would produce it there.
          std::memcpy((*region)->data(), req.input().data().data(), req.input().data().size());
          *req.mutable_input()->mutable_shared_memory() =
              client::SharedRef("bench", 0, req.input().data().size());
          req.mutable_input()->clear_data();
          *req.mutable_output_shared_memory() =
              client::SharedRef("bench", uint64_t(output_at), uint64_t(max_bytes / 64 + 4096));
        }
        v1::ForwardRequest header_only = req;  // zero-copy: the bytes go by reference
        header_only.mutable_input()->clear_data();
        std::vector<double> times, server_times, wire_times;
        const auto begin = Clock::now();
        for (int r = 0; r < 3 || Since(begin) < seconds_per_point; ++r) {
          v1::ForwardRequest copy;
          if (chunked) copy = req;  // the chunked writer consumes it; copied outside the timing
          const auto t0 = Clock::now();
          absl::StatusOr<client::ForwardResult> unused;
          double server_s = 0;
          if (chunked) {
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
            auto stream = stub->ForwardChunked(&ctx);
            wire::ChunkSplitter splitter(wire::Slots(copy), int64_t(4) << 20);
            v1::ForwardRequestPart part;
            *part.mutable_header() = std::move(copy);
            bool ok = stream->Write(part);
            while (ok && splitter.Next(part.mutable_chunk())) ok = stream->Write(part);
            stream->WritesDone();
            v1::ForwardResponsePart resp;
            while (stream->Read(&resp)) {
              if (resp.has_header()) server_s = resp.header().server_seconds();
            }
            const grpc::Status s = stream->Finish();
            if (!s.ok()) {
              std::fprintf(stderr, "\nwire_bench: ForwardChunked: %s\n", s.error_message().c_str());
              return 1;
            }
          } else if (zero_copy) {
            // The client's zero-copy path: the tensor bytes go out as a slice of their own that
            // points at the caller's buffer, and the output is read where it arrived.
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
            grpc::ByteBuffer out, in;
            wire::SerializeReferencing(header_only, {{2, req.input().data()}}, nullptr, &out);
            const grpc::Status s =
                grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
                    channel.get(), forward_method, &ctx, out, &in);
            if (!s.ok()) {
              std::fprintf(stderr, "\nwire_bench: Forward (zero-copy): %s\n",
                           s.error_message().c_str());
              return 1;
            }
            wire::ReceivedMessage received;
            v1::ForwardResponse resp;
            if (!received.Parse(in, &resp, wire::kForwardResponseTensors).ok()) {
              std::fprintf(stderr, "\nwire_bench: malformed response\n");
              return 1;
            }
            server_s = resp.server_seconds();
          } else {
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
            v1::ForwardResponse resp;
            const grpc::Status s = stub->Forward(&ctx, req, &resp);
            if (!s.ok()) {
              std::fprintf(stderr, "\nwire_bench: Forward: %s\n", s.error_message().c_str());
              return 1;
            }
            server_s = resp.server_seconds();
          }
          times.push_back(Since(t0));
          server_times.push_back(server_s);
          wire_times.push_back(times.back() - server_s);
          if (r >= 200) break;
        }
        rows.push_back(
            {path, name, request_bytes, Median(times), Median(server_times), Median(wire_times)});
      }
    }
  }
  std::fprintf(stderr, "\r%-60s\r", "");
  const CopyFigures copies = MeasureCopies(int64_t(64) << 20, 5);

  // Table: one line per size, dtype and path, next to TCP and memcpy of the same size.
  std::printf("%-9s %-5s %-10s %10s %10s %8s %8s\n", "size", "dtype", "path", "GiB/s", "wire GiB/s",
              "÷ tcp", "÷ memcpy");
  double tcp_rate = 0, memcpy_rate = 0;
  auto ratio_to = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  for (const Row& r : rows) {
    if (r.path == "tcp") tcp_rate = r.gib_s();
    if (r.path == "memcpy") memcpy_rate = r.gib_s();
    const bool base = r.path == "tcp" || r.path == "memcpy";
    const double wire_rate = base ? r.gib_s() : r.wire_gib_s();
    std::printf("%-9s %-5s %-10s %10.2f %10.2f %8.2f %8.2f\n", Human(r.bytes).c_str(),
                r.dtype.c_str(), r.path.c_str(), r.gib_s(), wire_rate,
                ratio_to(wire_rate, tcp_rate), ratio_to(wire_rate, memcpy_rate));
  }
  std::printf(
      "\nGiB/s of request bytes, end to end; 'wire': with the server's own time (decode, compute,\n"
      "encode; not the transport) taken out. The ratios are of the wire rate to raw loopback TCP\n"
      "(same bytes, one-byte answer) and to one memcpy of the same bytes, both measured in this\n"
      "run on this machine. unary: a standard protobuf client; zero-copy: the client's zero-copy\n"
      "path; chunked: 4 MiB chunks; shm: the tensor in a registered shared-memory region.\n");
  std::printf(
      "\ncopies at 64 MiB (median of 5): F32 decode as a view %.2f ms, with a copy %.2f ms;\n"
      "chunks written in place %.2f ms, collected then joined %.2f ms\n",
      copies.view_s * 1e3, copies.copy_s * 1e3, copies.in_place_s * 1e3, copies.join_s * 1e3);

  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << "{\n  \"benchmark\": \"wire\",\n  \"http2_frame_kib\": " << frame_kib
        << ",\n  \"module\": {\"kind\": \"LINEAR\", \"in\": " << kIn << ", \"out\": " << kOut
        << "},\n  \"hardware_threads\": " << std::thread::hardware_concurrency()
        << ",\n  \"rows\": [\n";
    double tcp = 0, mcpy = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      if (r.path == "tcp") tcp = r.gib_s();
      if (r.path == "memcpy") mcpy = r.gib_s();
      // Ratios of the wire rate (server time out) to TCP and to memcpy of the same size.
      const double rate = r.path == "tcp" || r.path == "memcpy" ? r.gib_s() : r.wire_gib_s();
      out << "    {\"path\": \"" << r.path << "\", \"dtype\": \"" << r.dtype
          << "\", \"bytes\": " << r.bytes << ", \"seconds\": " << r.seconds
          << ", \"server_seconds\": " << r.server_seconds
          << ", \"wire_seconds\": " << r.wire_seconds << ", \"gib_per_s\": " << r.gib_s()
          << ", \"wire_gib_per_s\": " << rate << ", \"ratio_to_tcp\": " << ratio_to(rate, tcp)
          << ", \"ratio_to_memcpy\": " << ratio_to(rate, mcpy) << "}"
          << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    out << "  ],\n  \"copies_64mib\": {\"decode_view_s\": " << copies.view_s
        << ", \"decode_copy_s\": " << copies.copy_s
        << ", \"chunks_in_place_s\": " << copies.in_place_s
        << ", \"chunks_joined_s\": " << copies.join_s << "}\n}\n";
    std::fprintf(stderr, "wrote %s\n", json_path.c_str());
  }
  (void)server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
