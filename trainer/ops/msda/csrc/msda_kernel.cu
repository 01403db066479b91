// CUDA kernels of multi-scale deformable attention (Deformable DETR, arXiv 2010.04159, eq. 3; DINO's
// MultiScaleDeformableAttention op has the same interface). Written from the definition, not copied:
//   out[n, q, m, d] = sum_{l, p} A[n, q, m, l, p] * bilinear(V_l[n, :, :, m, d], x, y)
//   x = loc_x * W_l - 0.5, y = loc_y * H_l - 0.5            (F.grid_sample, align_corners=False)
// with zero padding outside the H_l x W_l grid. One thread per (n, q, m) and VEC = 4, 2 or 1 adjacent channels d
// (the widest that divides D and the pointers' alignment): one VEC-wide load per bilinear corner, one VEC-wide
// store. Index arithmetic is 32-bit whenever every tensor has fewer than 2^31 - 2^20 elements (64-bit integer
// division is emulated on NVIDIA GPUs), 64-bit with VEC = 1 otherwise; the level table (H, W, start) is read once
// per block into shared memory.
// Backward: grad_value by atomic adds into an opmath (fp32/fp64) buffer, one float2/float4 vector atomic per corner
// on sm_90+ (CUDA's vector atomics, sm_90_rt.h), VEC scalar atomics before; grad_sampling_loc and grad_attn_weight
// are sums over d, reduced with warp shuffles across the lanes that share (n, q, m) and stored by the group's
// leader when one group covers the head (D / VEC a power of two <= 32, e.g. D = 32), else atomically added.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "msda.h"

namespace {

constexpr int kThreads = 256;  // a multiple of 32: every lane group lies in one warp

template <typename idx_t>
struct DimsT {
  idx_t S, Lq, M, D, L, P;
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename acc_t, typename idx_t>
struct Corners {
  idx_t off[4];
  acc_t w[4];
  acc_t lx, ly, hx, hy;
  bool inside;

  __device__ __forceinline__ Corners(acc_t x, acc_t y, idx_t H, idx_t W) {
    inside = x > acc_t(-1) && y > acc_t(-1) && x < acc_t(W) && y < acc_t(H);
    const idx_t x0 = inside ? static_cast<idx_t>(::floor(x)) : 0;
    const idx_t y0 = inside ? static_cast<idx_t>(::floor(y)) : 0;
    lx = x - acc_t(x0);
    ly = y - acc_t(y0);
    hx = acc_t(1) - lx;
    hy = acc_t(1) - ly;
    const bool left = x0 >= 0, right = x0 + 1 < W, top = y0 >= 0, bottom = y0 + 1 < H;
    off[0] = (inside && top && left) ? y0 * W + x0 : -1;
    off[1] = (inside && top && right) ? y0 * W + x0 + 1 : -1;
    off[2] = (inside && bottom && left) ? (y0 + 1) * W + x0 : -1;
    off[3] = (inside && bottom && right) ? (y0 + 1) * W + x0 + 1 : -1;
    w[0] = hy * hx;
    w[1] = hy * lx;
    w[2] = ly * hx;
    w[3] = ly * lx;
  }
};

// VEC channels at p (aligned to VEC elements), widened to acc_t.
template <int VEC, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_vec(const scalar_t* p, acc_t (&out)[VEC]) {
  const Pack<scalar_t, VEC> q = *reinterpret_cast<const Pack<scalar_t, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = static_cast<acc_t>(q.v[i]);
}

template <int VEC, typename scalar_t, typename acc_t>
__device__ __forceinline__ void store_vec(scalar_t* p, const acc_t (&in)[VEC]) {
  Pack<scalar_t, VEC> q;
#pragma unroll
  for (int i = 0; i < VEC; ++i) q.v[i] = static_cast<scalar_t>(in[i]);
  *reinterpret_cast<Pack<scalar_t, VEC>*>(p) = q;
}

template <int VEC>
__device__ __forceinline__ void atomic_add_vec(float* p, const float (&v)[VEC]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (VEC == 4) {
    atomicAdd(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));
  } else if constexpr (VEC == 2) {
    atomicAdd(reinterpret_cast<float2*>(p), make_float2(v[0], v[1]));
  } else {
    atomicAdd(p, v[0]);
  }
#else
#pragma unroll
  for (int i = 0; i < VEC; ++i) atomicAdd(p + i, v[i]);
#endif
}

template <int VEC>
__device__ __forceinline__ void atomic_add_vec(double* p, const double (&v)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) gpuAtomicAdd(p + i, v[i]);
}

template <typename acc_t>
__device__ __forceinline__ acc_t lane_group_sum(acc_t v, int group) {
  for (int offset = group >> 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Level table (H, W, start) of the L levels in dynamic shared memory, as idx_t.
template <typename idx_t>
__device__ __forceinline__ const idx_t* load_levels(const int64_t* shapes, const int64_t* starts, idx_t L) {
  extern __shared__ __align__(16) unsigned char levels_smem[];
  idx_t* lv = reinterpret_cast<idx_t*>(levels_smem);
  for (int i = threadIdx.x; i < L; i += blockDim.x) {
    lv[3 * i] = static_cast<idx_t>(shapes[2 * i]);
    lv[3 * i + 1] = static_cast<idx_t>(shapes[2 * i + 1]);
    lv[3 * i + 2] = static_cast<idx_t>(starts[i]);
  }
  __syncthreads();
  return lv;
}

// One thread per (n, q, m, VEC channels).
template <typename scalar_t, typename acc_t, typename idx_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    msda_forward_kernel(const scalar_t* __restrict__ value, const int64_t* __restrict__ shapes,
                           const int64_t* __restrict__ starts, const scalar_t* __restrict__ loc,
                           const scalar_t* __restrict__ attn, scalar_t* __restrict__ out, DimsT<idx_t> s,
                           idx_t total) {
  const idx_t* lv = load_levels<idx_t>(shapes, starts, s.L);
  const idx_t t = static_cast<idx_t>(blockIdx.x) * kThreads + static_cast<idx_t>(threadIdx.x);
  if (t >= total) return;
  const idx_t DV = s.D / VEC;
  const idx_t dv = t % DV;
  const idx_t mt = t / DV;  // (n * Lq + q) * M + m
  const idx_t m = mt % s.M;
  const idx_t n = mt / (s.M * s.Lq);
  const idx_t pixel_stride = s.M * s.D;
  const idx_t ap0 = mt * s.L * s.P;
  acc_t acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0;
  for (idx_t l = 0; l < s.L; ++l) {
    const idx_t H = lv[3 * l], W = lv[3 * l + 1];
    const scalar_t* v = value + ((n * s.S + lv[3 * l + 2]) * s.M + m) * s.D + dv * VEC;
    for (idx_t p = 0; p < s.P; ++p) {
      const idx_t ap = ap0 + l * s.P + p;
      const acc_t x = static_cast<acc_t>(loc[2 * ap]) * acc_t(W) - acc_t(0.5);
      const acc_t y = static_cast<acc_t>(loc[2 * ap + 1]) * acc_t(H) - acc_t(0.5);
      const Corners<acc_t, idx_t> b(x, y, H, W);
      if (!b.inside) continue;
      acc_t val[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) val[i] = 0;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (b.off[c] < 0) continue;
        acc_t q[VEC];
        load_vec<VEC>(v + b.off[c] * pixel_stride, q);
#pragma unroll
        for (int i = 0; i < VEC; ++i) val[i] += b.w[c] * q[i];
      }
      const acc_t a = static_cast<acc_t>(attn[ap]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += a * val[i];
    }
  }
  store_vec<VEC>(out + t * VEC, acc);
}

// Every thread runs the full (l, p) loop, also those past `total`, because the shuffles need all 32 lanes.
// `group`: lanes sharing (n, q, m), a power of two <= 32 dividing D / VEC; `exclusive`: group == D / VEC, so the
// group's leader is the only writer of its grad_loc / grad_attn elements (which are then stored, not added).
template <typename scalar_t, typename acc_t, typename idx_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    msda_backward_kernel(const scalar_t* __restrict__ value, const int64_t* __restrict__ shapes,
                            const int64_t* __restrict__ starts, const scalar_t* __restrict__ loc,
                            const scalar_t* __restrict__ attn, const scalar_t* __restrict__ grad_out,
                            acc_t* __restrict__ grad_value, acc_t* __restrict__ grad_loc,
                            acc_t* __restrict__ grad_attn, DimsT<idx_t> s, idx_t total, int group, bool exclusive) {
  const idx_t* lv = load_levels<idx_t>(shapes, starts, s.L);
  const idx_t t = static_cast<idx_t>(blockIdx.x) * kThreads + static_cast<idx_t>(threadIdx.x);
  const bool valid = t < total;
  const idx_t tt = valid ? t : 0;
  const idx_t DV = s.D / VEC;
  const idx_t dv = tt % DV;
  const idx_t mt = tt / DV;
  const idx_t m = mt % s.M;
  const idx_t n = mt / (s.M * s.Lq);
  const idx_t pixel_stride = s.M * s.D;
  const idx_t ap0 = mt * s.L * s.P;
  acc_t g[VEC];
  if (valid) {
    load_vec<VEC>(grad_out + t * VEC, g);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) g[i] = 0;
  }
  const bool leader = valid && (dv % group == 0);
  for (idx_t l = 0; l < s.L; ++l) {
    const idx_t H = lv[3 * l], W = lv[3 * l + 1];
    const idx_t vbase = ((n * s.S + lv[3 * l + 2]) * s.M + m) * s.D + dv * VEC;
    const scalar_t* v = value + vbase;
    acc_t* gv = grad_value + vbase;
    for (idx_t p = 0; p < s.P; ++p) {
      const idx_t ap = ap0 + l * s.P + p;
      acc_t ga = 0, gx = 0, gy = 0;
      if (valid) {
        const acc_t x = static_cast<acc_t>(loc[2 * ap]) * acc_t(W) - acc_t(0.5);
        const acc_t y = static_cast<acc_t>(loc[2 * ap + 1]) * acc_t(H) - acc_t(0.5);
        const Corners<acc_t, idx_t> b(x, y, H, W);
        if (b.inside) {
          acc_t c[4][VEC];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (b.off[k] >= 0) {
              load_vec<VEC>(v + b.off[k] * pixel_stride, c[k]);
            } else {
#pragma unroll
              for (int i = 0; i < VEC; ++i) c[k][i] = 0;
            }
          }
          const acc_t a = static_cast<acc_t>(attn[ap]);
          acc_t gw[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const acc_t val = b.w[0] * c[0][i] + b.w[1] * c[1][i] + b.w[2] * c[2][i] + b.w[3] * c[3][i];
            gw[i] = g[i] * a;
            ga += g[i] * val;
            gx += gw[i] * (b.hy * (c[1][i] - c[0][i]) + b.ly * (c[3][i] - c[2][i])) * acc_t(W);
            gy += gw[i] * (b.hx * (c[2][i] - c[0][i]) + b.lx * (c[3][i] - c[1][i])) * acc_t(H);
          }
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (b.off[k] < 0) continue;
            acc_t upd[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) upd[i] = gw[i] * b.w[k];
            atomic_add_vec<VEC>(gv + b.off[k] * pixel_stride, upd);
          }
        }
      }
      ga = lane_group_sum(ga, group);
      gx = lane_group_sum(gx, group);
      gy = lane_group_sum(gy, group);
      if (leader) {
        if (exclusive) {
          grad_attn[ap] = ga;
          grad_loc[2 * ap] = gx;
          grad_loc[2 * ap + 1] = gy;
        } else {
          gpuAtomicAdd(grad_attn + ap, ga);
          gpuAtomicAdd(grad_loc + 2 * ap, gx);
          gpuAtomicAdd(grad_loc + 2 * ap + 1, gy);
        }
      }
    }
  }
}

// Element offsets of batch chunk n0 in value (and grad_value), loc, attn and out (and grad_output).
struct ChunkOffsets {
  int64_t value, loc, attn, out;
};

ChunkOffsets chunk_offsets(const at::Tensor& value, const at::Tensor& loc, int64_t n0) {
  const int64_t N = value.size(0);
  return {n0 * (value.numel() / N), n0 * (loc.numel() / N), n0 * (loc.numel() / N / 2),
          n0 * (loc.size(1) * value.size(2) * value.size(3))};
}

// Every index a kernel computes stays below the largest of these element counts.
bool fits_int32(const at::Tensor& value, const at::Tensor& loc) {
  constexpr int64_t kLimit = (int64_t{1} << 31) - (int64_t{1} << 20);
  const int64_t out = value.size(0) * loc.size(1) * value.size(2) * value.size(3);
  return value.numel() < kLimit && loc.numel() < kLimit && out < kLimit;
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// Channels per thread: the widest of 4, 2, 1 that divides D and to which value / out / grad_out are aligned.
// 64-bit indexing runs VEC = 1 only.
int pick_vec(int64_t D, bool idx32, int64_t elem, std::initializer_list<const void*> ptrs) {
  int vec = 4;
  if (!idx32) return 1;
  while (vec > 1) {
    bool ok = D % vec == 0;
    for (const void* p : ptrs) ok = ok && aligned(p, vec * elem);
    if (ok) break;
    vec /= 2;
  }
  return vec;
}

template <typename idx_t>
DimsT<idx_t> dims_as(const at::Tensor& value, const at::Tensor& loc) {
  return DimsT<idx_t>{static_cast<idx_t>(value.size(1)), static_cast<idx_t>(loc.size(1)),
                      static_cast<idx_t>(value.size(2)), static_cast<idx_t>(value.size(3)),
                      static_cast<idx_t>(loc.size(3)),   static_cast<idx_t>(loc.size(4))};
}

unsigned int blocks_for(int64_t threads) { return static_cast<unsigned int>((threads + kThreads - 1) / kThreads); }

// Threads of one batch chunk of `step` images (one per (n, q, m) and VEC channels) and the level table's shared
// memory, for both kernels.
template <int VEC>
int64_t threads_per_chunk(const at::Tensor& value, const at::Tensor& loc, int64_t step) {
  return step * loc.size(1) * value.size(2) * value.size(3) / VEC;
}

template <typename idx_t>
size_t levels_smem(const at::Tensor& loc) {
  return 3 * loc.size(3) * sizeof(idx_t);
}

// Calls launch(offsets) for each batch chunk [n0, n0 + step) (DINO's im2col_step) and checks the launch.
template <typename Launch>
void for_each_chunk(const at::Tensor& value, const at::Tensor& loc, int64_t step, const Launch& launch) {
  for (int64_t n0 = 0; n0 < value.size(0); n0 += step) {
    launch(chunk_offsets(value, loc, n0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Calls fn.template operator()<idx_t, VEC>() for the kernel form: 64-bit indexing with VEC = 1, else 32-bit with
// the VEC that pick_vec chose.
template <typename Fn>
void with_form(bool idx32, int vec, const Fn& fn) {
  if (!idx32) {
    fn.template operator()<int64_t, 1>();
  } else if (vec == 4) {
    fn.template operator()<int, 4>();
  } else if (vec == 2) {
    fn.template operator()<int, 2>();
  } else {
    fn.template operator()<int, 1>();
  }
}

int64_t chunk_of(int64_t N, int64_t im2col_step) { return std::max<int64_t>(1, std::min(N, im2col_step)); }

}  // namespace

at::Tensor msda_cuda_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                             const at::Tensor& level_start_index, const at::Tensor& sampling_loc,
                             const at::Tensor& attn_weight, int64_t im2col_step) {
  const c10::cuda::CUDAGuard guard(value.device());
  const int64_t N = value.size(0);
  auto out = at::empty({N, sampling_loc.size(1), value.size(2) * value.size(3)}, value.options());
  if (out.numel() == 0) return out;
  if (value.size(1) == 0) return out.zero_();
  const int64_t step = chunk_of(N, im2col_step);
  const bool idx32 = fits_int32(value, sampling_loc);
  const int v = pick_vec(value.size(3), idx32, value.element_size(),
                         {value.const_data_ptr(), out.const_data_ptr()});
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, value.scalar_type(),
                                  "msda_cuda_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_form(idx32, v, [&]<typename idx_t, int VEC>() {
      const auto s = dims_as<idx_t>(value, sampling_loc);
      const int64_t threads = threads_per_chunk<VEC>(value, sampling_loc, step);
      for_each_chunk(value, sampling_loc, step, [&](const ChunkOffsets& o) {
        msda_forward_kernel<scalar_t, acc_t, idx_t, VEC>
            <<<blocks_for(threads), kThreads, levels_smem<idx_t>(sampling_loc), stream>>>(
                value.const_data_ptr<scalar_t>() + o.value, spatial_shapes.const_data_ptr<int64_t>(),
                level_start_index.const_data_ptr<int64_t>(), sampling_loc.const_data_ptr<scalar_t>() + o.loc,
                attn_weight.const_data_ptr<scalar_t>() + o.attn, out.mutable_data_ptr<scalar_t>() + o.out, s,
                static_cast<idx_t>(threads));
      });
    });
  });
  return out;
}

std::vector<at::Tensor> msda_cuda_backward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                           const at::Tensor& level_start_index, const at::Tensor& sampling_loc,
                                           const at::Tensor& attn_weight, const at::Tensor& grad_output,
                                           int64_t im2col_step) {
  const c10::cuda::CUDAGuard guard(value.device());
  const int64_t N = value.size(0), D = value.size(3);
  const auto acc_opts = value.options().dtype(at::toOpMathType(value.scalar_type()));
  const int64_t step = chunk_of(N, im2col_step);
  const bool idx32 = fits_int32(value, sampling_loc);
  const int v = pick_vec(D, idx32, value.element_size(),
                         {value.const_data_ptr(), grad_output.const_data_ptr()});
  const int64_t DV = D / v;
  int group = 1;  // lanes sharing (n, q, m): the largest power of two dividing D / VEC, at most a warp
  while (group < 32 && DV % (2 * group) == 0) group *= 2;
  const bool exclusive = group == DV;
  auto grad_value = at::zeros(value.sizes(), acc_opts);
  auto grad_loc = exclusive ? at::empty(sampling_loc.sizes(), acc_opts) : at::zeros(sampling_loc.sizes(), acc_opts);
  auto grad_attn = exclusive ? at::empty(attn_weight.sizes(), acc_opts) : at::zeros(attn_weight.sizes(), acc_opts);
  const bool empty_problem = N == 0 || sampling_loc.size(1) == 0 || value.size(2) == 0 || D == 0;
  if (empty_problem || value.size(1) == 0) {
    grad_loc.zero_();
    grad_attn.zero_();
  } else {
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, value.scalar_type(),
                                    "msda_cuda_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      with_form(idx32, v, [&]<typename idx_t, int VEC>() {
        const auto s = dims_as<idx_t>(value, sampling_loc);
        const int64_t threads = threads_per_chunk<VEC>(value, sampling_loc, step);
        for_each_chunk(value, sampling_loc, step, [&](const ChunkOffsets& o) {
          msda_backward_kernel<scalar_t, acc_t, idx_t, VEC>
              <<<blocks_for(threads), kThreads, levels_smem<idx_t>(sampling_loc), stream>>>(
                  value.const_data_ptr<scalar_t>() + o.value, spatial_shapes.const_data_ptr<int64_t>(),
                  level_start_index.const_data_ptr<int64_t>(), sampling_loc.const_data_ptr<scalar_t>() + o.loc,
                  attn_weight.const_data_ptr<scalar_t>() + o.attn, grad_output.const_data_ptr<scalar_t>() + o.out,
                  grad_value.mutable_data_ptr<acc_t>() + o.value, grad_loc.mutable_data_ptr<acc_t>() + o.loc,
                  grad_attn.mutable_data_ptr<acc_t>() + o.attn, s, static_cast<idx_t>(threads), group, exclusive);
        });
      });
    });
  }
  const auto dtype = value.scalar_type();
  return {grad_value.to(dtype), grad_loc.to(dtype), grad_attn.to(dtype)};
}
