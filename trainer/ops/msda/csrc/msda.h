// Multi-scale deformable attention (Deformable DETR, arXiv 2010.04159; DINO, arXiv 2203.03605).
// Shapes: value (N, S, M, D); spatial_shapes (L, 2) int64 (H, W); level_start_index (L,) int64;
// sampling_loc (N, Lq, M, L, P, 2) in [0, 1] as (x, y); attn_weight (N, Lq, M, L, P); output (N, Lq, M*D).
#pragma once
#include <ATen/core/Tensor.h>  // not torch/extension.h: keeps pybind11/Python out of the .cu compile
#include <vector>

at::Tensor msda_cuda_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                             const at::Tensor& level_start_index, const at::Tensor& sampling_loc,
                             const at::Tensor& attn_weight, int64_t im2col_step);

std::vector<at::Tensor> msda_cuda_backward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                           const at::Tensor& level_start_index, const at::Tensor& sampling_loc,
                                           const at::Tensor& attn_weight, const at::Tensor& grad_output,
                                           int64_t im2col_step);
