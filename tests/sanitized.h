// Whether this test binary is built with ASan or TSan. Their runtimes have allocators of their own
// (and ASan a quarantine): RSS figures and glibc's malloc_trim say nothing about leaks there;
// LeakSanitizer covers those builds instead.
#pragma once

namespace gradwire::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

// Whether it is built with TSan, which slows a gRPC round trip by one to two orders of magnitude:
// what a test derives from timing (deadlines, slacks) must scale with it.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitized = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kThreadSanitized = true;
#else
inline constexpr bool kThreadSanitized = false;
#endif
#else
inline constexpr bool kThreadSanitized = false;
#endif

}  // namespace gradwire::testing
