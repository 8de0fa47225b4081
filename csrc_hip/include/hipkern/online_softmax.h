// Softmax state in the log2 domain, as flash-decoding keeps it: m (a reference max of the scaled
// scores), l (sum of exp2(score - m)), and an unnormalised output. Partial states over disjoint key
// sets merge exactly: scale each by exp2(m_i - M) with M = max m_i. Any m works as long as l and the
// output are taken against it; a kernel may keep a stale m (below the running max by at most
// kRescaleSlack) so that it rescales its output only when the max grows by more (see below).
#pragma once

#include "hipkern/platform.h"

namespace hk {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// How far (log2 units) the running max may rise above a state's m before the state is rescaled to it:
// until then exp2(score - m) <= 2^8, far inside float32 and the 16-bit types a P tile is rounded to,
// and each rescale of the output (one multiply per accumulator) is skipped. (The same rule as
// FlashAttention-4's conditional rescaling; the result is the same up to rounding.)
constexpr float kRescaleSlack = 8.f;

// Weight of a partial state with max m inside a merge whose max is M (0 for an empty state).
HK_DEVICE float merge_weight(float m, float M) { return m == -INFINITY ? 0.f : fast_exp2(m - M); }

// Natural-log LSE of a merged state; -inf when it saw no keys.
HK_DEVICE float lse_of(float M, float L) { return L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY; }

// The output of a merged state: O / L, or 0 when it saw no keys.
HK_DEVICE float normalise(float O, float L) { return L > 0.f ? O / L : 0.f; }

}  // namespace hk
