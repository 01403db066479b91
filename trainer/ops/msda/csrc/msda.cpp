// Python bindings and argument checks of the multi-scale deformable attention op (see msda.h).
#include <torch/extension.h>

#include "msda.h"

namespace {

void check_inputs(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                  const at::Tensor& sampling_loc, const at::Tensor& attn_weight, int64_t im2col_step) {
  const std::pair<const char*, const at::Tensor*> all[] = {
      {"value", &value}, {"spatial_shapes", &spatial_shapes}, {"level_start_index", &level_start_index},
      {"sampling_locations", &sampling_loc}, {"attention_weights", &attn_weight}};
  for (const auto& [name, t] : all) {
    TORCH_CHECK(t->is_cuda(), "msda: ", name, " must be a CUDA tensor, got device ", t->device());
    TORCH_CHECK(t->device() == value.device(), "msda: ", name, " is on ", t->device(), " but value is on ",
                value.device());
    TORCH_CHECK(t->is_contiguous(), "msda: ", name, " must be contiguous (call .contiguous())");
  }
  TORCH_CHECK(value.dim() == 4, "msda: value must be (N, S, M, D), got ", value.sizes());
  TORCH_CHECK(spatial_shapes.dim() == 2 && spatial_shapes.size(1) == 2 &&
                  spatial_shapes.scalar_type() == at::kLong,
              "msda: spatial_shapes must be (L, 2) int64, got ", spatial_shapes.sizes(), " ",
              spatial_shapes.scalar_type());
  const int64_t L = spatial_shapes.size(0);
  TORCH_CHECK(level_start_index.dim() == 1 && level_start_index.size(0) == L &&
                  level_start_index.scalar_type() == at::kLong,
              "msda: level_start_index must be (L,) = (", L, ",) int64, got ", level_start_index.sizes(), " ",
              level_start_index.scalar_type());
  const int64_t N = value.size(0), M = value.size(2);
  TORCH_CHECK(sampling_loc.dim() == 6 && sampling_loc.size(0) == N && sampling_loc.size(2) == M &&
                  sampling_loc.size(3) == L && sampling_loc.size(5) == 2,
              "msda: sampling_locations must be (N, Lq, M, L, P, 2) = (", N, ", Lq, ", M, ", ", L, ", P, 2), got ",
              sampling_loc.sizes());
  const int64_t Lq = sampling_loc.size(1), P = sampling_loc.size(4);
  TORCH_CHECK(attn_weight.dim() == 5 && attn_weight.size(0) == N && attn_weight.size(1) == Lq &&
                  attn_weight.size(2) == M && attn_weight.size(3) == L && attn_weight.size(4) == P,
              "msda: attention_weights must be (N, Lq, M, L, P) = (", N, ", ", Lq, ", ", M, ", ", L, ", ", P,
              "), got ", attn_weight.sizes());
  TORCH_CHECK(sampling_loc.scalar_type() == value.scalar_type() && attn_weight.scalar_type() == value.scalar_type(),
              "msda: value, sampling_locations and attention_weights must share one dtype, got ",
              value.scalar_type(), ", ", sampling_loc.scalar_type(), ", ", attn_weight.scalar_type());
  TORCH_CHECK(im2col_step > 0, "msda: im2col_step must be > 0, got ", im2col_step);
  const int64_t step = std::min(N, im2col_step);
  TORCH_CHECK(N == 0 || N % step == 0, "msda: im2col_step (", im2col_step, ") must divide the batch size N (", N,
              ")");
}

at::Tensor forward(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                   const at::Tensor& sampling_loc, const at::Tensor& attn_weight, int64_t im2col_step) {
  check_inputs(value, spatial_shapes, level_start_index, sampling_loc, attn_weight, im2col_step);
  return msda_cuda_forward(value, spatial_shapes, level_start_index, sampling_loc, attn_weight, im2col_step);
}

std::vector<at::Tensor> backward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                 const at::Tensor& level_start_index, const at::Tensor& sampling_loc,
                                 const at::Tensor& attn_weight, const at::Tensor& grad_output,
                                 int64_t im2col_step) {
  check_inputs(value, spatial_shapes, level_start_index, sampling_loc, attn_weight, im2col_step);
  const int64_t N = value.size(0), Lq = sampling_loc.size(1), M = value.size(2), D = value.size(3);
  TORCH_CHECK(grad_output.is_cuda() && grad_output.device() == value.device() && grad_output.is_contiguous(),
              "msda: grad_output must be a contiguous CUDA tensor on ", value.device());
  TORCH_CHECK(grad_output.scalar_type() == value.scalar_type(), "msda: grad_output dtype ",
              grad_output.scalar_type(), " != value dtype ", value.scalar_type());
  TORCH_CHECK(grad_output.numel() == N * Lq * M * D, "msda: grad_output must have N*Lq*M*D = ", N * Lq * M * D,
              " elements, got ", grad_output.sizes());
  return msda_cuda_backward(value, spatial_shapes, level_start_index, sampling_loc, attn_weight, grad_output,
                            im2col_step);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Multi-scale deformable attention CUDA kernels (fp32, fp64, fp16, bf16); see trainer/ops/msda.";
  m.def("forward", &forward, "output (N, Lq, M*D)", py::arg("value"), py::arg("spatial_shapes"),
        py::arg("level_start_index"), py::arg("sampling_locations"), py::arg("attention_weights"),
        py::arg("im2col_step"));
  m.def("backward", &backward, "[grad_value, grad_sampling_locations, grad_attention_weights]", py::arg("value"),
        py::arg("spatial_shapes"), py::arg("level_start_index"), py::arg("sampling_locations"),
        py::arg("attention_weights"), py::arg("grad_output"), py::arg("im2col_step"));
}
