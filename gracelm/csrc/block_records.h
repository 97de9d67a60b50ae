// The records block_matmul reads (GGUF's Q4_0, Q4_1, Q8_0 blocks, packed by gracelm/model/block_linear.py),
// shared by its two kernels: block_matmul.cpp (AVX-512 VNNI, every row count) and block_matmul_amx.cpp
// (AMX, bfloat16 activations of 16 rows or more).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace gracelm::blocks {

constexpr int64_t kBlock = 32;  // inputs per block: one scale and one minimum
constexpr int64_t kLanes = 16;  // outputs per tile: one int32 or float32 vector
constexpr int64_t kAhead = 4;   // records prefetched ahead

// Bytes of one (tile, block) record: the 16 x 32 weights, then 16 float16 scales and 16 float16 minimums.
constexpr int64_t weight_bytes(int64_t bits) { return kLanes * kBlock * bits / 8; }
constexpr int64_t record_bytes(int64_t bits) { return weight_bytes(bits) + 2 * kLanes * 2; }

#define GRACELM_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

GRACELM_AVX512 inline void store_row(__m512 sums, float* out) { _mm512_storeu_ps(out, sums); }

// float32 -> bfloat16, rounded to nearest even (as torch rounds).
GRACELM_AVX512 inline void store_row(__m512 sums, c10::BFloat16* out) {
  const __m512i bits = _mm512_castps_si512(sums);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// Calls of at least this many rows of bfloat16 activations by 4-bit weights go to the AMX kernel where it
// serves: below, its tiles of 16 rows would be mostly padding.
constexpr int64_t kAmxMinRows = 16;

// Whether a CPU that runs the 8-bit kernel (block_matmul_serves) also has AMX with bfloat16 tiles, and the
// OS lets this process use them (asked once).
bool amx_serves();

// out [rows, n] = x [rows, K] (bfloat16) @ W.T for 4-bit records `packed` [tiles, K / 32, record bytes].
void amx_multiply(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& out);

}  // namespace gracelm::blocks
