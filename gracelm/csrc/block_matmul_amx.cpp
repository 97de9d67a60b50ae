// block_matmul's kernel for CPUs with AMX (Sapphire Rapids and later): bfloat16 activations of 16 rows or
// more by 4-bit records. Each record is dequantized to bfloat16 (scale * q + minimum, computed in float32 and
// rounded once, the value the dense bfloat16 copy holds) as the tile unit's A operand, 16 outputs x 32
// inputs; the activations are its B operand, 16 rows a tile; the tile unit sums each output's whole row of
// products in float32 (tdpbf16ps), so no per-block scaling is left to the vector units, which only
// dequantize. Why and the figures: gracelm/model/block_linear.py.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include "block_records.h"

namespace gracelm::blocks {
namespace {

#define GRACELM_AMX \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,f16c,fma,amx-tile,amx-bf16")))

constexpr int kGroup = 16;  // rows per activation tile
constexpr int kSets = 4;    // groups summed at once: tile registers 4..7

// Column c of a dequantized block (A's row of an output, 32 bfloat16) holds input column_input(c): c < 16
// the low nibble of the output's packed byte c, c >= 16 the high nibble of byte c - 16, where byte 4h + i
// (record bytes 64h + 4o + i) holds inputs 8h + i (low) and 8h + 4 + i (high). Columns 2j and 2j + 1 are
// adjacent inputs, so the activations' pairs (B's layout) are whole 32-bit words of a row.
constexpr int column_input(int c) { return 8 * ((c & 15) >> 2) + (c & 3) + (c >= 16 ? 4 : 0); }

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile register 16 rows of 64 bytes: tmm0 a block's weights, tmm2, tmm3 activations (alternate
// groups), tmm4..7 the sums of up to 4 groups of rows. The configuration is per thread.
GRACELM_AMX void configure_tiles() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = 16;
    config.colsb[i] = 64;
  }
  _tile_loadconfig(&config);
}

// 16 x 16 32-bit words transposed: rows[i] word j -> rows[j] word i.
GRACELM_AMX void transpose16(__m512i rows[16]) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(rows[2 * k], rows[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(rows[2 * k], rows[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + c], 128-bit lane l: word 4l + c of rows 4k..4k+3
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i w0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88),
                  w1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    rows[c] = _mm512_shuffle_i32x4(w0, w2, 0x88);
    rows[4 + c] = _mm512_shuffle_i32x4(w1, w3, 0x88);
    rows[8 + c] = _mm512_shuffle_i32x4(w0, w2, 0xDD);
    rows[12 + c] = _mm512_shuffle_i32x4(w1, w3, 0xDD);
  }
}

// The activations as B tiles, one per (group of 16 rows, block) at b + (group * blocks + block) * 512: pair
// row j holds, for each of the 16 rows, the 32-bit word of inputs column_input(2j), +1 (rows past the last:
// 0).
GRACELM_AMX void pair_activations(const c10::BFloat16* x, int64_t rows, int64_t k, int64_t group,
                                  int64_t block, c10::BFloat16* b) {
  const int64_t blocks = k / kBlock;
  __m512i words[16];  // row n's block: 16 words of 2 inputs
  for (int n = 0; n < kGroup; ++n) {
    const int64_t r = group * kGroup + n;
    words[n] = r < rows ? _mm512_loadu_si512(x + r * k + block * kBlock) : _mm512_setzero_si512();
  }
  transpose16(words);  // words[w]: word w of every row
  auto* tile = reinterpret_cast<__m512i*>(b + (group * blocks + block) * 512);
  for (int j = 0; j < 16; ++j) _mm512_store_si512(tile + j, words[column_input(2 * j) / 2]);
}

// One 4-bit record as an A tile: output o's row at a + 32 o, its weights in column_input order. Each
// output's 16 values (scale * q + minimum, q = 0..15) are a table, twice over 32 words, that vpermw
// indexes by the nibbles (bit 4 of an index, left from the other nibble, picks the same table).
GRACELM_AMX void dequantize(const uint8_t* record, c10::BFloat16* a) {
  alignas(64) float scale[16], minimum[16];
  alignas(64) uint8_t bytes[4][64];  // bytes[o % 4][16 (o / 4) ..]: output o's 16 packed bytes
  const uint8_t* tail = record + weight_bytes(4);
  _mm512_store_ps(scale, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail))));
  _mm512_store_ps(minimum, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 32))));
  // The record's 4 x 64 bytes (chunk h, word o: output o's bytes 4h..4h+3) to 16 bytes per output.
  const __m512i c0 = _mm512_loadu_si512(record), c1 = _mm512_loadu_si512(record + 64);
  const __m512i c2 = _mm512_loadu_si512(record + 128), c3 = _mm512_loadu_si512(record + 192);
  const __m512i t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
  const __m512i t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
  _mm512_store_si512(bytes[0], _mm512_unpacklo_epi64(t0, t2));
  _mm512_store_si512(bytes[1], _mm512_unpackhi_epi64(t0, t2));
  _mm512_store_si512(bytes[2], _mm512_unpacklo_epi64(t1, t3));
  _mm512_store_si512(bytes[3], _mm512_unpackhi_epi64(t1, t3));
  // Read back through memory: broadcast loads, where the compiler would otherwise extract lanes and shuffle
  // on the one port that vpermw needs (measured 8 % slower).
  asm volatile("" ::: "memory");
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int o = 0; o < 16; ++o) {
    const __m512 values = _mm512_fmadd_ps(iota, _mm512_set1_ps(scale[o]), _mm512_set1_ps(minimum[o]));
    const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(values, values));
    const __m128i packed = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes[o & 3] + 16 * (o >> 2)));
    __m512i index = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(packed));
    index = _mm512_mask_srli_epi16(index, 0xFFFF0000u, index, 4);  // columns 16..31: the high nibbles
    _mm512_store_si512(a + 32 * o, _mm512_permutexvar_epi16(index, table));
  }
}

// A sums tile as stored (16 outputs x 16 rows, float32) to out's rows r0.. of tile t.
GRACELM_AMX void store_sums(const float* sums, int64_t t, int64_t r0, int64_t rows, c10::BFloat16* out,
                            int64_t n) {
  const int valid = static_cast<int>(std::min<int64_t>(kGroup, rows - r0));
  const int width = static_cast<int>(std::min<int64_t>(kLanes, n - t * kLanes));
  // Row r of the output tile is column r of the sums: every 16th float from r.
  const __m512i column =
      _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  alignas(64) c10::BFloat16 partial[kLanes];
  for (int r = 0; r < valid; ++r) {
    const __m512 row = _mm512_i32gather_ps(column, sums + r, 4);
    c10::BFloat16* to = out + (r0 + r) * n + t * kLanes;
    if (width == kLanes) {
      store_row(row, to);
    } else {
      store_row(row, partial);
      std::copy(partial, partial + width, to);
    }
  }
}

// Tiles begin..end, each over up to kSets groups of rows at a time; `b` the paired activations.
GRACELM_AMX void amx_tiles(const uint8_t* packed, int64_t begin, int64_t end, const c10::BFloat16* b,
                           int64_t rows, int64_t blocks, c10::BFloat16* out, int64_t n) {
  configure_tiles();
  const int64_t tile_bytes = blocks * record_bytes(4), groups = (rows + kGroup - 1) / kGroup;
  alignas(64) c10::BFloat16 a[16 * 32];
  alignas(64) float sums[16 * 16];
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* tile = packed + t * tile_bytes;
    for (int64_t first = 0; first < groups; first += kSets) {
      const int64_t sets = std::min<int64_t>(kSets, groups - first);
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t g = 0; g < blocks; ++g) {
        const uint8_t* record = tile + g * record_bytes(4);
        for (int64_t line = 0; line < record_bytes(4); line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(record + kAhead * record_bytes(4) + line), _MM_HINT_T0);
        dequantize(record, a);
        const c10::BFloat16* activations = b + (first * blocks + g) * 512;
        const int64_t group_stride = blocks * 512;
        _tile_loadd(0, a, 64);
        _tile_loadd(2, activations, 64);
        _tile_dpbf16ps(4, 0, 2);
        if (sets > 1) {
          _tile_loadd(3, activations + group_stride, 64);
          _tile_dpbf16ps(5, 0, 3);
        }
        if (sets > 2) {
          _tile_loadd(2, activations + 2 * group_stride, 64);
          _tile_dpbf16ps(6, 0, 2);
        }
        if (sets > 3) {
          _tile_loadd(3, activations + 3 * group_stride, 64);
          _tile_dpbf16ps(7, 0, 3);
        }
      }
      // (Tile registers are named by literals only.)
      const int64_t r0 = first * kGroup;
      _tile_stored(4, sums, 64);
      store_sums(sums, t, r0, rows, out, n);
      if (sets > 1) {
        _tile_stored(5, sums, 64);
        store_sums(sums, t, r0 + kGroup, rows, out, n);
      }
      if (sets > 2) {
        _tile_stored(6, sums, 64);
        store_sums(sums, t, r0 + 2 * kGroup, rows, out, n);
      }
      if (sets > 3) {
        _tile_stored(7, sums, 64);
        store_sums(sums, t, r0 + 3 * kGroup, rows, out, n);
      }
    }
  }
  _tile_release();
}

// What the AMX kernel needs beyond the 8-bit kernel's AVX-512 VNNI (block_matmul_serves).
bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1, amx_bf16 = (d >> 22) & 1;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  const bool avx512_bf16 = (a >> 5) & 1;
  return tile && amx_bf16 && avx512_bf16;
}

}  // namespace

bool amx_serves() {
  // Linux gives a process the tile registers' state only once asked (ARCH_REQ_XCOMP_PERM for XTILEDATA);
  // the grant covers every thread of the process.
  static const bool serves = cpu_has_amx_bf16() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return serves;
}

void amx_multiply(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  const int64_t groups = (rows + kGroup - 1) / kGroup;
  at::Tensor paired = at::empty({groups * blocks * 512}, x.options());
  const auto* activations = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* b = paired.data_ptr<c10::BFloat16>();
  at::parallel_for(0, groups * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pair_activations(activations, rows, k, i / blocks, i % blocks, b);
  });
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, packed.size(0), 4, [&](int64_t begin, int64_t end) {
    amx_tiles(weights, begin, end, b, rows, blocks, o, n);
  });
}

}  // namespace gracelm::blocks
