// torch's 4-bit weight-only matmul on the CPU (`aten::_weight_int4pack_mm_for_cpu`) as an op of gracelm's:
// `torch.ops.gracelm.int4_matmul`. The same call, but opaque to inductor, which lowers torch's own op in a
// compiled decode graph to a variant taking the group size as a tensor it makes a constant of the graph: a
// constant the model does not have, where a graph takes every constant from the loaded model
// (gracelm/model/decode_graph.py).
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                       const at::Tensor& scales_zeros) {
  return at::_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gracelm, m) {
  m.def("int4_matmul(Tensor x, Tensor packed, int group_size, Tensor scales_zeros) -> Tensor");
}

TORCH_LIBRARY_IMPL(gracelm, CPU, m) { m.impl("int4_matmul", &int4_matmul); }
