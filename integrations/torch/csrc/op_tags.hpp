#pragma once
// The tags every lce operator carries (register.cpp, losses.cpp).
//
// cudagraph_unsafe: on CUDA tensors a call synchronises its stream once (the
// targets' range check), a backward reads on the host whether any target was
// ignored, the losses run on the host, and the first call of an option set
// creates a cuBLAS handle. None of that can be captured in a CUDA graph, and
// torch.compile's CUDA graphs (mode="reduce-overhead") cannot see it inside
// the kernels: the tag makes them leave these operators out instead of
// failing in capture.

#include <ATen/core/enum_tag.h>

#include <vector>

namespace lce_torch {

inline const std::vector<at::Tag>& op_tags() {
  static const std::vector<at::Tag> tags{at::Tag::cudagraph_unsafe};
  return tags;
}

}  // namespace lce_torch
