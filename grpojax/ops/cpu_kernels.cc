// The decode step's two native CPU kernels, as XLA FFI custom calls: see
// cpu_kernels.py, which builds this file with the system's C++ compiler on
// first use.
// - Decode attention over a KV cache held in segments. XLA:CPU runs the
//   [M, H] x [H, S] products of each (row, kv head) as hundreds of tiny
//   batched matmuls; this kernel streams each row's keys and values once, on
//   two threads (the step is memory-bound), with one online softmax across
//   all segments.
// - Dense layers, x [M, K] times weights packed in panels of 64 output
//   columns, for the few dozen rows of a decode step: XLA:CPU's GEMM repacks
//   the weight on every call and reaches ~40% of the FMA peak at 64 rows.
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace grpojax {

// GCC/Clang vector types: one AVX-512 register, or two AVX2 / four SSE ones,
// whichever -march allows. (aligned(4): loads from any float address.)
typedef float f16v __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));
typedef float f8v __attribute__((vector_size(32), aligned(4)));

constexpr int kBlock = 16;  // cache slots per block: one f16v of scores
constexpr int kMaxHead = 512;

// exp(x) for x <= 0 (scores minus their running max): Cody-Waite reduction
// to r in [-ln2/2, ln2/2] and a degree-6 Taylor polynomial, ~2e-7 relative.
static inline f16v Exp(f16v x) {
  const f16v lo = x * 0 - 87.0f;
  x = x < lo ? lo : x;
  const f16v y = x * 1.44269504f;
  const f16v n = (y + 12582912.0f) - 12582912.0f;  // round to nearest
  const f16v r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  f16v p = r * (1.0f / 720) + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  f16v scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

static inline f16v Load16(const float* p) { return *reinterpret_cast<const f16v*>(p); }
static inline f8v Load8(const float* p) { return *reinterpret_cast<const f8v*>(p); }

// Up to 4 queries (QT) against one cache row, sharing its loads: continues
// each query's online softmax over the row's slots, in blocks of 16.
// q[i] [H]; k [H, S] (slot minor); v [S, H]; visible[i] [S]; H % 8 == 0.
// State in and out: o[i] [H] = sum_t exp(s_t - m) v_t over the slots seen so
// far, m[i] their largest score (-FLT_MAX before any) and l[i] = sum_t exp(s_t - m).
template <int QT>
static inline void AttendTile(const float* const* q, const float* k, const float* v,
                              const bool* const* visible, int64_t S, int64_t H,
                              float* const* o, float* m, float* l) {
  const int64_t H8 = H / 8;
  f8v acc[QT][kMaxHead / 8];
  for (int i = 0; i < QT; ++i) std::memcpy(acc[i], o[i], sizeof(float) * H);
  float kt[kMaxHead * kBlock];  // zero-padded copies of a partial last block
  float vt[kBlock * kMaxHead];
  for (int64_t t0 = 0; t0 < S; t0 += kBlock) {
    const int64_t n = S - t0 < kBlock ? S - t0 : kBlock;
    bool seen = false;  // skip blocks no query sees (e.g. unwritten cache slots)
    for (int i = 0; i < QT; ++i)
      for (int t = 0; t < n; ++t) seen |= visible[i][t0 + t];
    if (!seen) continue;
    const float* kb = k + t0;
    int64_t kstride = S;
    const float* vb = v + t0 * H;
    if (n < kBlock) {
      for (int64_t h = 0; h < H; ++h)
        for (int t = 0; t < kBlock; ++t) kt[h * kBlock + t] = t < n ? k[h * S + t0 + t] : 0.f;
      std::memset(vt, 0, sizeof(float) * kBlock * H);
      std::memcpy(vt, vb, sizeof(float) * n * H);
      kb = kt, kstride = kBlock, vb = vt;
    }
    // Two partial sums per query: independent FMA chains.
    f16v s0[QT] = {}, s1[QT] = {};
    for (int64_t h = 0; h < H; h += 2) {
      const f16v k0 = Load16(kb + h * kstride), k1 = Load16(kb + (h + 1) * kstride);
      for (int i = 0; i < QT; ++i) {
        s0[i] += q[i][h] * k0;
        s1[i] += q[i][h + 1] * k1;
      }
    }
    float p[QT][kBlock];
    for (int i = 0; i < QT; ++i) {
      const f16v s = s0[i] + s1[i];
      float sv[kBlock];
      std::memcpy(sv, &s, sizeof(sv));
      const bool* vis = visible[i] + t0;
      float bm = -FLT_MAX;
      for (int t = 0; t < n; ++t)
        if (vis[t] && sv[t] > bm) bm = sv[t];
      if (bm == -FLT_MAX) {  // nothing visible to this query in this block
        for (int t = 0; t < kBlock; ++t) p[i][t] = 0.f;
        continue;
      }
      if (bm > m[i]) {
        const float scale = m[i] == -FLT_MAX ? 0.f : Exp(f16v{} + (m[i] - bm))[0];
        for (int64_t j = 0; j < H8; ++j) acc[i][j] *= scale;
        l[i] *= scale;
        m[i] = bm;
      }
      const f16v e = Exp(s - m[i]);
      std::memcpy(p[i], &e, sizeof(p[i]));
      for (int t = 0; t < kBlock; ++t) {
        p[i][t] = (t < n && vis[t]) ? p[i][t] : 0.f;
        l[i] += p[i][t];
      }
    }
    for (int t = 0; t < n; ++t) {
      const float* vr = vb + t * H;
      for (int64_t j = 0; j < H8; ++j) {
        const f8v vv = Load8(vr + 8 * j);
        for (int i = 0; i < QT; ++i) acc[i][j] += p[i][t] * vv;
      }
    }
  }
  for (int i = 0; i < QT; ++i) std::memcpy(o[i], acc[i], sizeof(float) * H);
}

struct Segment {
  const float* k;        // [R, K, H, S]
  const float* v;        // [R, K, S, H]
  const bool* visible;   // [N, S]
  int64_t R, S;
};

// Query rows b*G0 .. b*G0+G0-1 and kv head kh, over every segment: a
// segment's cache row r is read by its g = N / R query rows r*g .. r*g+g-1
// (G0 is the largest g; every g divides it). q and out [N, K, M, H]; m and l
// hold this group's softmax state, [G0 * M].
static inline void AttendGroup(const float* q, const Segment* segments, int64_t num_segments,
                               int64_t N, int64_t K, int64_t M, int64_t H, int64_t G0,
                               int64_t b, int64_t kh, float* out, float* m, float* l) {
  auto row = [&](int64_t n, int64_t mi) { return (n * K + kh) * M + mi; };
  for (int64_t j = 0; j < G0 * M; ++j) {
    std::memset(out + row(b * G0 + j / M, j % M) * H, 0, sizeof(float) * H);
    m[j] = -FLT_MAX, l[j] = 0.f;
  }
  for (int64_t si = 0; si < num_segments; ++si) {
    const Segment& seg = segments[si];
    const int64_t g = N / seg.R;
    for (int64_t r = b * G0 / g; r < (b + 1) * G0 / g; ++r) {
      const float* kp = seg.k + (r * K + kh) * H * seg.S;
      const float* vp = seg.v + (r * K + kh) * seg.S * H;
      for (int64_t i0 = 0; i0 < g * M; i0 += 4) {  // the g * M queries of row r, by 4
        const int qt = g * M - i0 < 4 ? static_cast<int>(g * M - i0) : 4;
        const float* qs[4];
        const bool* vis[4];
        float* os[4];
        float ms[4], ls[4];
        int64_t js[4];
        for (int i = 0; i < qt; ++i) {
          const int64_t n = r * g + (i0 + i) / M, mi = (i0 + i) % M;
          js[i] = (n - b * G0) * M + mi;
          qs[i] = q + row(n, mi) * H, vis[i] = seg.visible + n * seg.S;
          os[i] = out + row(n, mi) * H, ms[i] = m[js[i]], ls[i] = l[js[i]];
        }
        switch (qt) {
          case 4: AttendTile<4>(qs, kp, vp, vis, seg.S, H, os, ms, ls); break;
          case 3: AttendTile<3>(qs, kp, vp, vis, seg.S, H, os, ms, ls); break;
          case 2: AttendTile<2>(qs, kp, vp, vis, seg.S, H, os, ms, ls); break;
          default: AttendTile<1>(qs, kp, vp, vis, seg.S, H, os, ms, ls);
        }
        for (int i = 0; i < qt; ++i) m[js[i]] = ms[i], l[js[i]] = ls[i];
      }
    }
  }
  for (int64_t j = 0; j < G0 * M; ++j) {
    float* o = out + row(b * G0 + j / M, j % M) * H;
    const float inv = 1.f / l[j];  // the caller's masks leave every query a visible slot
    for (int64_t h = 0; h < H; ++h) o[h] *= inv;
  }
}

// ---------------------------------------------------------------- dense

constexpr int kPanel = 64;  // output columns per weight panel: four f16v
constexpr int kRows = 6;    // rows per register tile: 6 x 4 accumulators

// Rows a[0 .. MR) (row stride lda) times one panel b [K, 64] into
// c[0 .. MR) x [0, ncols) (row stride ldc): MR x 4 accumulators over all of K,
// one broadcast of a per row and four vector loads of b per k. Meanwhile
// prefetches pf_rows rows of 64 floats from pf (a share of the next panel),
// spread evenly over the k loop: the weights stream from memory, and a burst
// of prefetches at the start of a panel leaves its first tiles waiting.
template <int MR>
static inline void DenseTile(const float* a, int64_t lda, const float* b, int64_t K, float* c,
                             int64_t ldc, int ncols, const float* pf, int64_t pf_rows) {
  constexpr int NV = kPanel / 16;
  f16v acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = f16v{};
  const int64_t every = pf_rows > 0 ? (K + pf_rows - 1) / pf_rows : K + 1;
  int64_t countdown = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (countdown-- == 0) {
      countdown = every - 1;
      if (pf_rows-- > 0) {
        for (int j = 0; j < NV; ++j) __builtin_prefetch(pf + 16 * j, 0, 2);
        pf += kPanel;
      }
    }
    f16v bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = Load16(b + k * kPanel + 16 * j);
    for (int i = 0; i < MR; ++i) {
      const f16v av = f16v{} + a[i * lda + k];
      for (int j = 0; j < NV; ++j) acc[i][j] += av * bv[j];
    }
  }
  for (int i = 0; i < MR; ++i) std::memcpy(c + i * ldc, acc[i], sizeof(float) * ncols);
}

// All M rows of x [M, K] times panel p of w [P, K, 64] into out [M, N]; the
// row tiles share the prefetch of panel p + 1 when there is one.
static inline void DensePanel(const float* x, const float* w, int64_t M, int64_t K, int64_t N,
                              int64_t p, bool prefetch_next, float* out) {
  const float* b = w + p * K * kPanel;
  const int ncols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
  const int64_t tiles = (M + kRows - 1) / kRows;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r = t * kRows, lo = t * K / tiles, hi = (t + 1) * K / tiles;
    const float* pf = prefetch_next ? b + K * kPanel + lo * kPanel : nullptr;
    const int64_t pf_rows = prefetch_next ? hi - lo : 0;
    const float* a = x + r * K;
    float* c = out + r * N + p * kPanel;
    switch (std::min<int64_t>(kRows, M - r)) {
      case 6: DenseTile<6>(a, K, b, K, c, N, ncols, pf, pf_rows); break;
      case 5: DenseTile<5>(a, K, b, K, c, N, ncols, pf, pf_rows); break;
      case 4: DenseTile<4>(a, K, b, K, c, N, ncols, pf, pf_rows); break;
      case 3: DenseTile<3>(a, K, b, K, c, N, ncols, pf, pf_rows); break;
      case 2: DenseTile<2>(a, K, b, K, c, N, ncols, pf, pf_rows); break;
      default: DenseTile<1>(a, K, b, K, c, N, ncols, pf, pf_rows);
    }
  }
}

// Panel p of the weight whose rows are those of the parts, one after another
// ([N, K] in all): panel[k * 64 + j] = row 64p + j, column k (zero past N).
// Transposed in 64 x 16 blocks: 64 source cache lines in, 64 out.
static inline void PackPanel(const float* const* parts, const int64_t* part_rows,
                             int64_t num_parts, int64_t K, int64_t p, float* panel) {
  const float* rows[kPanel];
  for (int j = 0; j < kPanel; ++j) {
    int64_t n = p * kPanel + j, part = 0;
    while (part < num_parts && n >= part_rows[part]) n -= part_rows[part++];
    rows[j] = part < num_parts ? parts[part] + n * K : nullptr;
  }
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t kn = std::min<int64_t>(16, K - k0);
    for (int j = 0; j < kPanel; ++j)
      for (int64_t k = 0; k < kn; ++k) panel[(k0 + k) * kPanel + j] = rows[j] ? rows[j][k0 + k] : 0.f;
  }
}

}  // namespace grpojax

namespace ffi = xla::ffi;

// Runs body(i) for every i in [0, total) on the calling thread and up to
// threads - 1 tasks of XLA's pool, items claimed one at a time; returns when
// all are done. The counters and the body are held by shared_ptrs, as a
// helper task may start after the call has returned (it then finds no item
// left and touches nothing else).
template <typename Body>
static void ParallelFor(ffi::ThreadPool& pool, int64_t total, int64_t threads, Body body) {
  struct Work {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto work = std::make_shared<Work>();
  auto shared_body = std::make_shared<Body>(std::move(body));
  auto run = [work, shared_body, total] {
    for (int64_t i; (i = work->next.fetch_add(1)) < total;) {
      (*shared_body)(i);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < std::min(threads, total) - 1; ++t) pool.Schedule([run] { run(); });
  run();
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

// q [N, K, M, H], then (k, v, visible) per segment -> out [N, K, M, H].
static ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                  ffi::RemainingArgs rest, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  if (qd.size() != 4 || rest.size() == 0 || rest.size() % 3 != 0)
    return ffi::Error::InvalidArgument("decode attention: q [N, K, M, H], then (k, v, visible) triples");
  const int64_t N = qd[0], K = qd[1], M = qd[2], H = qd[3];
  if (H % 8 != 0 || H > grpojax::kMaxHead)
    return ffi::Error::InvalidArgument("decode attention: head_dim must be a multiple of 8, at most 512");
  std::vector<grpojax::Segment> segments;
  int64_t min_rows = N;
  for (size_t i = 0; i < rest.size(); i += 3) {
    auto k = rest.get<ffi::Buffer<ffi::F32>>(i);
    auto v = rest.get<ffi::Buffer<ffi::F32>>(i + 1);
    auto visible = rest.get<ffi::Buffer<ffi::PRED>>(i + 2);
    if (!k.has_value() || !v.has_value() || !visible.has_value())
      return ffi::Error::InvalidArgument("decode attention: segments are (f32 k, f32 v, bool visible)");
    const auto kd = k->dimensions(), vd = v->dimensions(), sd = visible->dimensions();
    if (kd.size() != 4 || vd.size() != 4 || sd.size() != 2)
      return ffi::Error::InvalidArgument("decode attention: k, v of rank 4, visible of rank 2");
    const int64_t R = kd[0], S = kd[3];
    if (kd[1] != K || kd[2] != H || vd[0] != R || vd[1] != K || vd[2] != S || vd[3] != H ||
        sd[0] != N || sd[1] != S || R == 0 || N % R != 0)
      return ffi::Error::InvalidArgument("decode attention: inconsistent segment shapes");
    segments.push_back({k->typed_data(), v->typed_data(), visible->typed_data(), R, S});
    min_rows = std::min(min_rows, R);
  }
  for (const auto& seg : segments)
    if (seg.R % min_rows != 0)
      return ffi::Error::InvalidArgument("decode attention: segment rows must be multiples of the fewest");
  const int64_t G0 = N / min_rows;
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  // The decode step is memory-bound: a second thread nearly doubles the bandwidth.
  ParallelFor(pool, min_rows * K, pool.num_threads(), [=, segments = std::move(segments)](int64_t i) {
    std::vector<float> state(2 * G0 * M);  // this (group, kv head)'s softmax state
    grpojax::AttendGroup(qp, segments.data(), segments.size(), N, K, M, H, G0, i / K, i % K, op,
                         state.data(), state.data() + G0 * M);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpojaxDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// x [M, K] times w [P, K, 64] (panel p holds output columns 64p .. 64p+63 of
// a [N, K] weight, zero past N) -> out [M, N].
static ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[2] != grpojax::kPanel)
    return ffi::Error::InvalidArgument("dense: x [M, K], w [P, K, 64], out [M, N]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], N = od[1];
  if (wd[1] != K || od[0] != M || N > P * grpojax::kPanel || N <= (P - 1) * grpojax::kPanel)
    return ffi::Error::InvalidArgument("dense: inconsistent shapes");
  if (M == 0) return ffi::Error::Success();
  // Contiguous runs of panels per item: a thread prefetches the panel it does next.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = std::max<int64_t>(1, P / (4 * threads));
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  ParallelFor(pool, (P + per_item - 1) / per_item, threads, [=](int64_t i) {
    const int64_t end = std::min(P, (i + 1) * per_item);
    for (int64_t p = i * per_item; p < end; ++p)
      grpojax::DensePanel(xp, wp, M, K, N, p, p + 1 < end, op);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpojaxDense, Dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Stacked weights [L, n_i, K], as L weights [N = sum n_i, K] -> L results
// [P, K, 64] for Dense: every layer in one call, reading the stacked buffers
// in place (a per-layer operand would be a sliced copy).
static ffi::Error Pack(ffi::ThreadPool pool, ffi::RemainingArgs parts, ffi::RemainingRets outs) {
  if (parts.size() == 0 || outs.size() == 0)
    return ffi::Error::InvalidArgument("pack: weights [L, n_i, K] -> L results [P, K, 64]");
  const int64_t L = outs.size();
  std::vector<const float*> ptrs;
  std::vector<int64_t> rows;
  int64_t N = 0, K = -1;
  for (size_t i = 0; i < parts.size(); ++i) {
    auto w = parts.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || w->dimensions().size() != 3 || w->dimensions()[0] != L ||
        (K >= 0 && w->dimensions()[2] != K))
      return ffi::Error::InvalidArgument("pack: every weight is f32 [L, n_i, K]");
    K = w->dimensions()[2];
    ptrs.push_back(w->typed_data());
    rows.push_back(w->dimensions()[1]);
    N += rows.back();
  }
  const int64_t P = (N + grpojax::kPanel - 1) / grpojax::kPanel;
  std::vector<float*> out_ptrs;
  for (int64_t l = 0; l < L; ++l) {
    auto o = outs.get<ffi::Buffer<ffi::F32>>(l);
    if (!o.has_value()) return o.error();
    const auto od = (*o)->dimensions();
    if (od.size() != 3 || od[0] != P || od[1] != K || od[2] != grpojax::kPanel)
      return ffi::Error::InvalidArgument("pack: results are [ceil(N / 64), K, 64]");
    out_ptrs.push_back((*o)->typed_data());
  }
  ParallelFor(pool, L * P, pool.num_threads(),
              [=, ptrs = std::move(ptrs), rows = std::move(rows),
               out_ptrs = std::move(out_ptrs)](int64_t i) {
    const int64_t l = i / P, p = i % P;
    std::vector<const float*> layer(ptrs.size());  // layer l of each part
    for (size_t j = 0; j < ptrs.size(); ++j) layer[j] = ptrs[j] + l * rows[j] * K;
    grpojax::PackPanel(layer.data(), rows.data(), ptrs.size(), K, p,
                       out_ptrs[l] + p * K * grpojax::kPanel);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpojaxPack, Pack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets());
