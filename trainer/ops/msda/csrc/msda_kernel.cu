// CUDA kernels of multi-scale deformable attention (Deformable DETR, arXiv 2010.04159, eq. 3; DINO's
// MultiScaleDeformableAttention op has the same interface). Written from the definition, not copied:
//   out[n, q, m, d] = sum_{l, p} A[n, q, m, l, p] * bilinear(V_l[n, :, :, m, d], x, y)
//   x = loc_x * W_l - 0.5, y = loc_y * H_l - 0.5            (F.grid_sample, align_corners=False)
// with zero padding outside the H_l x W_l grid. One thread per output element (n, q, m, d); d is the fastest
// index, so the D threads of one (n, q, m) read contiguous channels of each sampled pixel.
// Backward: grad_value by atomic adds into an opmath (fp32/fp64) buffer; grad_sampling_loc and
// grad_attn_weight are sums over d, reduced with warp shuffles across the G = gcd(D, 32) lanes that share
// (n, q, m) and then added once per group (exactly one add per element when D is a multiple of 32).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "msda.h"

namespace {

constexpr int kThreads = 256;  // a multiple of 32: every warp is full, every lane group lies in one warp

struct Dims {
  int64_t S, Lq, M, D, L, P;
};

// The four bilinear corners of pixel position (x, y) on an H x W grid; a corner outside the grid has offset -1
// (zero padding). Offsets count pixels (multiply by M * D for elements).
template <typename acc_t>
struct Bilinear {
  int64_t off[4];
  acc_t w[4];
  acc_t lx, ly, hx, hy;
  bool inside;  // false: all four corners are outside, the sample is exactly zero

  __device__ __forceinline__ Bilinear(acc_t x, acc_t y, int64_t H, int64_t W) {
    inside = x > acc_t(-1) && y > acc_t(-1) && x < acc_t(W) && y < acc_t(H);
    const int64_t x0 = inside ? static_cast<int64_t>(::floor(x)) : 0;
    const int64_t y0 = inside ? static_cast<int64_t>(::floor(y)) : 0;
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

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t load_or_zero(const scalar_t* base, int64_t off, int64_t pixel_stride) {
  return off < 0 ? acc_t(0) : static_cast<acc_t>(base[off * pixel_stride]);
}

template <typename scalar_t, typename acc_t>
__global__ void msda_forward_kernel(const scalar_t* __restrict__ value, const int64_t* __restrict__ shapes,
                                    const int64_t* __restrict__ starts, const scalar_t* __restrict__ loc,
                                    const scalar_t* __restrict__ attn, scalar_t* __restrict__ out, Dims s,
                                    int64_t total) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= total) return;
  const int64_t d = t % s.D;
  const int64_t m = (t / s.D) % s.M;
  const int64_t nq = t / (s.D * s.M);  // n * Lq + q
  const int64_t n = nq / s.Lq;
  const int64_t pixel_stride = s.M * s.D;
  const int64_t ap0 = (nq * s.M + m) * s.L * s.P;  // index of (n, q, m, 0, 0) in attn; loc is 2x
  acc_t acc = 0;
  for (int64_t l = 0; l < s.L; ++l) {
    const int64_t H = shapes[2 * l], W = shapes[2 * l + 1];
    const scalar_t* v = value + ((n * s.S + starts[l]) * s.M + m) * s.D + d;
    for (int64_t p = 0; p < s.P; ++p) {
      const int64_t ap = ap0 + l * s.P + p;
      const acc_t x = static_cast<acc_t>(loc[2 * ap]) * acc_t(W) - acc_t(0.5);
      const acc_t y = static_cast<acc_t>(loc[2 * ap + 1]) * acc_t(H) - acc_t(0.5);
      const Bilinear<acc_t> b(x, y, H, W);
      if (!b.inside) continue;
      acc_t val = 0;
#pragma unroll
      for (int c = 0; c < 4; ++c) val += b.w[c] * load_or_zero<scalar_t, acc_t>(v, b.off[c], pixel_stride);
      acc += static_cast<acc_t>(attn[ap]) * val;
    }
  }
  out[t] = static_cast<scalar_t>(acc);
}

template <typename acc_t>
__device__ __forceinline__ acc_t group_sum(acc_t v, int group) {
  for (int offset = group >> 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Every thread of the grid runs the full (l, p) loop, also those past `total`, because the shuffles need
// all 32 lanes of a warp; such threads contribute zeros and write nothing.
template <typename scalar_t, typename acc_t>
__global__ void msda_backward_kernel(const scalar_t* __restrict__ value, const int64_t* __restrict__ shapes,
                                     const int64_t* __restrict__ starts, const scalar_t* __restrict__ loc,
                                     const scalar_t* __restrict__ attn, const scalar_t* __restrict__ grad_out,
                                     acc_t* __restrict__ grad_value, acc_t* __restrict__ grad_loc,
                                     acc_t* __restrict__ grad_attn, Dims s, int64_t total, int group) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool valid = t < total;
  const int64_t tt = valid ? t : 0;
  const int64_t d = tt % s.D;
  const int64_t m = (tt / s.D) % s.M;
  const int64_t nq = tt / (s.D * s.M);
  const int64_t n = nq / s.Lq;
  const int64_t pixel_stride = s.M * s.D;
  const int64_t ap0 = (nq * s.M + m) * s.L * s.P;
  const acc_t g = valid ? static_cast<acc_t>(grad_out[t]) : acc_t(0);
  const bool leader = valid && (d % group == 0);
  for (int64_t l = 0; l < s.L; ++l) {
    const int64_t H = shapes[2 * l], W = shapes[2 * l + 1];
    const int64_t vbase = ((n * s.S + starts[l]) * s.M + m) * s.D + d;
    const scalar_t* v = value + vbase;
    acc_t* gv = grad_value + vbase;
    for (int64_t p = 0; p < s.P; ++p) {
      const int64_t ap = ap0 + l * s.P + p;
      acc_t ga = 0, gx = 0, gy = 0;
      if (valid) {
        const acc_t x = static_cast<acc_t>(loc[2 * ap]) * acc_t(W) - acc_t(0.5);
        const acc_t y = static_cast<acc_t>(loc[2 * ap + 1]) * acc_t(H) - acc_t(0.5);
        const Bilinear<acc_t> b(x, y, H, W);
        if (b.inside) {
          acc_t c[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) c[k] = load_or_zero<scalar_t, acc_t>(v, b.off[k], pixel_stride);
          const acc_t val = b.w[0] * c[0] + b.w[1] * c[1] + b.w[2] * c[2] + b.w[3] * c[3];
          const acc_t gw = g * static_cast<acc_t>(attn[ap]);
          ga = g * val;
          gx = gw * (b.hy * (c[1] - c[0]) + b.ly * (c[3] - c[2])) * acc_t(W);  // d val / d loc_x
          gy = gw * (b.hx * (c[2] - c[0]) + b.lx * (c[3] - c[1])) * acc_t(H);  // d val / d loc_y
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (b.off[k] >= 0) gpuAtomicAdd(gv + b.off[k] * pixel_stride, gw * b.w[k]);
          }
        }
      }
      ga = group_sum(ga, group);
      gx = group_sum(gx, group);
      gy = group_sum(gy, group);
      if (leader) {
        gpuAtomicAdd(grad_attn + ap, ga);
        gpuAtomicAdd(grad_loc + 2 * ap, gx);
        gpuAtomicAdd(grad_loc + 2 * ap + 1, gy);
      }
    }
  }
}

Dims dims_of(const at::Tensor& value, const at::Tensor& loc) {
  return Dims{value.size(1), loc.size(1), value.size(2), value.size(3), loc.size(3), loc.size(4)};
}

// Element offsets of batch chunk n0 in value (and grad_value), loc, attn and out (and grad_output).
struct Offsets {
  int64_t value, loc, attn, out;
  Offsets(const Dims& s, int64_t n0)
      : value(n0 * s.S * s.M * s.D), loc(n0 * s.Lq * s.M * s.L * s.P * 2), attn(n0 * s.Lq * s.M * s.L * s.P),
        out(n0 * s.Lq * s.M * s.D) {}
};

// Calls launch(offsets) for each batch chunk [n0, n0 + step) (DINO's im2col_step) and checks the launch.
template <typename Launch>
void for_each_chunk(const Dims& s, int64_t N, int64_t step, const Launch& launch) {
  for (int64_t n0 = 0; n0 < N; n0 += step) {
    launch(Offsets(s, n0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

int64_t chunk_of(int64_t N, int64_t im2col_step) { return std::max<int64_t>(1, std::min(N, im2col_step)); }

unsigned int blocks_for(int64_t total) { return static_cast<unsigned int>((total + kThreads - 1) / kThreads); }

}  // namespace

at::Tensor msda_cuda_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                             const at::Tensor& level_start_index, const at::Tensor& sampling_loc,
                             const at::Tensor& attn_weight, int64_t im2col_step) {
  const c10::cuda::CUDAGuard guard(value.device());
  const Dims s = dims_of(value, sampling_loc);
  const int64_t N = value.size(0);
  auto out = at::empty({N, s.Lq, s.M * s.D}, value.options());
  const int64_t step = chunk_of(N, im2col_step);
  const int64_t total = step * s.Lq * s.M * s.D;
  if (N == 0 || total == 0) return out.zero_();
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, value.scalar_type(),
                                  "msda_cuda_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    for_each_chunk(s, N, step, [&](const Offsets& o) {
      msda_forward_kernel<scalar_t, acc_t><<<blocks_for(total), kThreads, 0, stream>>>(
          value.const_data_ptr<scalar_t>() + o.value, spatial_shapes.const_data_ptr<int64_t>(),
          level_start_index.const_data_ptr<int64_t>(), sampling_loc.const_data_ptr<scalar_t>() + o.loc,
          attn_weight.const_data_ptr<scalar_t>() + o.attn, out.mutable_data_ptr<scalar_t>() + o.out, s, total);
    });
  });
  return out;
}

std::vector<at::Tensor> msda_cuda_backward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                           const at::Tensor& level_start_index, const at::Tensor& sampling_loc,
                                           const at::Tensor& attn_weight, const at::Tensor& grad_output,
                                           int64_t im2col_step) {
  const c10::cuda::CUDAGuard guard(value.device());
  const Dims s = dims_of(value, sampling_loc);
  const int64_t N = value.size(0);
  const auto acc_opts = value.options().dtype(at::toOpMathType(value.scalar_type()));
  auto grad_value = at::zeros(value.sizes(), acc_opts);
  auto grad_loc = at::zeros(sampling_loc.sizes(), acc_opts);
  auto grad_attn = at::zeros(attn_weight.sizes(), acc_opts);
  const int64_t step = chunk_of(N, im2col_step);
  const int64_t total = step * s.Lq * s.M * s.D;
  int group = 1;  // lanes sharing (n, q, m): the largest power of two dividing D, at most a warp
  while (group < 32 && s.D % (2 * group) == 0) group *= 2;
  if (N > 0 && total > 0) {
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, value.scalar_type(),
                                    "msda_cuda_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      for_each_chunk(s, N, step, [&](const Offsets& o) {
        msda_backward_kernel<scalar_t, acc_t><<<blocks_for(total), kThreads, 0, stream>>>(
            value.const_data_ptr<scalar_t>() + o.value, spatial_shapes.const_data_ptr<int64_t>(),
            level_start_index.const_data_ptr<int64_t>(), sampling_loc.const_data_ptr<scalar_t>() + o.loc,
            attn_weight.const_data_ptr<scalar_t>() + o.attn, grad_output.const_data_ptr<scalar_t>() + o.out,
            grad_value.mutable_data_ptr<acc_t>() + o.value, grad_loc.mutable_data_ptr<acc_t>() + o.loc,
            grad_attn.mutable_data_ptr<acc_t>() + o.attn, s, total, group);
      });
    });
  }
  const auto dtype = value.scalar_type();
  return {grad_value.to(dtype), grad_loc.to(dtype), grad_attn.to(dtype)};
}
