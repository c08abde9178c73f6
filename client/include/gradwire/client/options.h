// How a C++ client reaches gradwire-server and how it sends tensors.
#pragma once

#include <chrono>
#include <string>

#include "gradwire/client/host_tensor.h"

namespace gradwire::client {

struct ClientOptions {
  std::string server = "127.0.0.1:50051";    // host:port of gradwire-server
  std::chrono::milliseconds timeout{30000};  // deadline of each call
  // How activations and gradients cross (host_tensor.h, docs/wire.md): the exact wire by default
  // (F32 results bit for bit, a Linear's input as its FP8 cast); a WireDType sends every tensor in
  // it both ways (`wire_dtype = WireDType::kBF16`; BF16, F16 and FP8 are lossy).
  WireForm wire_dtype = kExactWire;
  int max_message_mib = 64;  // largest message sent or received
  // TLS: a PEM CA bundle that signed the server's certificate turns TLS on; a PEM client
  // certificate and key answer a server that requires mutual TLS. Empty: plaintext.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // The name the server's certificate must carry, when it is not the host of `server` (a probe
  // that dials 127.0.0.1 inside a pod whose certificate names the service).
  std::string tls_server_name;
  // Bearer token for a server that requires tokens: sent as "authorization: Bearer TOKEN" on every
  // call (health checks too; the server ignores it there).
  std::string token;
  // Every call sends a W3C `traceparent`, whose trace-id the server uses as the call's request id
  // in its logs and errors. Empty: a fresh trace-id per call (each call its own request id); 32
  // lowercase hex digits: this trace-id on every call (one trace over many calls, told apart on
  // the server by their parent ids).
  std::string trace_id;
  // Tensors larger than one chunk travel on the chunked calls (ForwardChunked, ...) in chunks of
  // this many KiB; it must not exceed the server's --chunk-kib. kAuto picks the call by the
  // request's and the expected response's size; kAlways / kNever force one (tests, benchmarks).
  int chunk_kib = 4096;
  enum class Chunking { kAuto, kAlways, kNever };
  Chunking chunking = Chunking::kAuto;
  // Same-host shared memory (docs/shared-memory.md). kAuto: a Forward or Backward whose tensors
  // reach shared_memory_min_kib asks the server for a region only this client can reach
  // (CreateSharedMemory), passes the tensors through it and reuses it. A server on another host,
  // in another container or under another user, or one with --shared-memory off, answers so or
  // gives an object this process cannot open: the client then uses the wire from there on,
  // without an error. kOff: always the wire.
  enum class SharedMemory { kAuto, kOff };
  SharedMemory shared_memory = SharedMemory::kAuto;
  int shared_memory_min_kib = 64;
};

}  // namespace gradwire::client
