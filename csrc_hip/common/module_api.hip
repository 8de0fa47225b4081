// Compiled into every hipkern module: the C ABI that Python's loader checks and uses for errors.
#include <stdio.h>

#include "hipkern/error.h"

namespace {
thread_local char g_last_error[512] = "";
}

namespace hk {

int set_error(int err, const char* what, const char* file, int line) {
  snprintf(g_last_error, sizeof(g_last_error), "%s failed at %s:%d: %s (%s, code %d)", what, file,
           line, hipGetErrorString((hipError_t)err), hipGetErrorName((hipError_t)err), err);
  return err;
}

int set_invalid(const char* what, const char* file, int line) {
  snprintf(g_last_error, sizeof(g_last_error), "%s failed at %s:%d", what, file, line);
  return (int)hipErrorInvalidValue;
}

// A CUDA module links its own runtime, whose current device is not torch's: every launcher makes
// the device of its tensors current first. Cheap when it already is.
int use_device(int device) {
  int cur = -1;
  HK_CHECK(hipGetDevice(&cur));
  if (cur != device) HK_CHECK(hipSetDevice(device));
  return 0;
}

}  // namespace hk

// Bumped when the module ABI (this file or the launcher conventions) changes.
HK_EXPORT int hk_module_abi_version() { return 1; }
HK_EXPORT int hk_wave_size() { return HK_WAVE_SIZE; }
HK_EXPORT const char* hk_last_error() { return g_last_error; }

// `bytes` of device memory on `device`, zeroed in order on `stream`, from the runtime rather than torch's caching
// allocator: state a module keeps across eager calls (fused_moe's arrival counters) then never lands in a CUDA
// graph's private pool (torch.compile's "reduce-overhead" warm-up routes the thread's allocations there) and never
// belongs to a graph. Never freed: the caller keeps it for the process's life.
HK_EXPORT int hk_alloc_zeroed(int device, int64_t bytes, void* stream, void** out) {
  HK_REQUIRE(bytes > 0 && out != nullptr);
  HK_TRY(hk::use_device(device));
  void* p = nullptr;
  hipError_t err = hipMalloc(&p, (size_t)bytes);
  if (err == hipSuccess) {
    err = hipMemsetAsync(p, 0, (size_t)bytes, (hipStream_t)stream);
    if (err != hipSuccess) (void)hipFree(p);
  }
  if (err != hipSuccess) {
    (void)hipGetLastError();  // (not left for the next launch's check to report as its own failure)
    return hk::set_error((int)err, "hipMalloc / hipMemsetAsync of zeroed memory", __FILE__, __LINE__);
  }
  *out = p;
  return 0;
}

