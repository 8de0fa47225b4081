// Softmax state in the log2 domain, as flash-decoding keeps it: m (running max of scaled scores),
// l (sum of exp2(score - m)), and an unnormalised output. Partial states over disjoint key sets
// merge exactly: scale each by exp2(m_i - M) with M = max m_i.
#pragma once

#include "hipkern/platform.h"

namespace hk {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Weight of a partial state with max m inside a merge whose max is M (0 for an empty state).
HK_DEVICE float merge_weight(float m, float M) { return m == -INFINITY ? 0.f : fast_exp2(m - M); }

// Natural-log LSE of a merged state; -inf when it saw no keys.
HK_DEVICE float lse_of(float M, float L) { return L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY; }

// The output of a merged state: O / L, or 0 when it saw no keys.
HK_DEVICE float normalise(float O, float L) { return L > 0.f ? O / L : 0.f; }

}  // namespace hk
