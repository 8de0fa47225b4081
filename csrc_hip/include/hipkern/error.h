// Error reporting of a module's extern "C" launchers. A launcher returns 0 or an error code of the
// runtime; the message naming the failing call is kept per thread and read by Python through the
// module's hk_last_error() (defined once per module in csrc_hip/common/module_api.hip).
#pragma once

#include "hipkern/platform.h"

namespace hk {
// Records "<what> failed at file:line: <runtime message>" for hk_last_error(); returns err.
int set_error(int err, const char* what, const char* file, int line);
// Records a message for an argument error detected by the launcher itself.
int set_invalid(const char* what, const char* file, int line);
// Makes `device` current for this module's runtime; 0 or an error code (message recorded).
int use_device(int device);
}  // namespace hk

// Evaluate a runtime call; on failure record which call failed and return its code.
#define HK_CHECK(call)                                                        \
  do {                                                                        \
    hipError_t hk_err_ = (call);                                              \
    if (hk_err_ != hipSuccess) return hk::set_error((int)hk_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a launch: return the launch error, naming the kernel.
#define HK_CHECK_LAUNCH(name)                                                 \
  do {                                                                        \
    hipError_t hk_err_ = hipGetLastError();                                   \
    if (hk_err_ != hipSuccess) return hk::set_error((int)hk_err_, "launch of " name, __FILE__, __LINE__); \
  } while (0)

#define HK_REQUIRE(cond)                                                      \
  do {                                                                        \
    if (!(cond)) return hk::set_invalid("requirement " #cond, __FILE__, __LINE__); \
  } while (0)

// Propagate a nonzero status of a hipkern helper (its message is already recorded).
#define HK_TRY(expr)                 \
  do {                               \
    int hk_rc_ = (expr);             \
    if (hk_rc_ != 0) return hk_rc_;  \
  } while (0)
