// Argument validation helpers of every heterospec host function (CPU and CUDA); the per-op
// metadata checks built from them live in op_checks.h.
// Every failure raises a ValueError (c10::ValueError) whose message names the op, the tensor and
// what was expected versus what was received, e.g.
//   "select_tree_nodes: expected parents of dtype torch.int64, got torch.int32".
// Header-only and lean: only c10 / ATen core headers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <sstream>
#include <string>

namespace heterospec {

// Python spelling of a dtype, so C++ and Python messages read the same.
inline const char* dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::BFloat16: return "torch.bfloat16";
    case c10::ScalarType::Long: return "torch.int64";
    case c10::ScalarType::Int: return "torch.int32";
    case c10::ScalarType::Short: return "torch.int16";
    case c10::ScalarType::Char: return "torch.int8";
    case c10::ScalarType::Byte: return "torch.uint8";
    case c10::ScalarType::Bool: return "torch.bool";
    default: return c10::toString(t);
  }
}

inline std::string sizes_str(const at::Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int64_t d = 0; d < t.dim(); ++d) os << (d ? ", " : "") << t.size(d);
  os << "]";
  return os.str();
}

#define HS_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

inline void check_defined(const char* op, const char* name, const at::Tensor& t) {
  HS_CHECK(t.defined(), op, ": expected ", name, " to be a tensor, got an undefined tensor");
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t, c10::ScalarType expected) {
  check_defined(op, name, t);
  HS_CHECK(t.scalar_type() == expected, op, ": expected ", name, " of dtype ", dtype_name(expected), ", got ",
           dtype_name(t.scalar_type()));
}

// Float logits: float32, float16 or bfloat16.
inline void check_float_dtype(const char* op, const char* name, const at::Tensor& t) {
  check_defined(op, name, t);
  const auto s = t.scalar_type();
  HS_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, op, ": expected ", name,
           " of dtype torch.float32, torch.float16 or torch.bfloat16, got ", dtype_name(s));
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim, const char* layout) {
  check_defined(op, name, t);
  HS_CHECK(t.dim() == dim, op, ": expected ", name, " to have ", dim, " dimensions ", layout, ", got ", t.dim(),
           " dimensions with shape ", sizes_str(t));
}

// t.size(d) must equal `expected`; `what` explains where the expectation comes from.
inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t d, int64_t expected,
                       const char* what) {
  HS_CHECK(t.size(d) == expected, op, ": expected ", name, ".size(", d, ") == ", expected, " (", what, "), got ",
           t.size(d), " (", name, " has shape ", sizes_str(t), ")");
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                              const at::Tensor& ref) {
  HS_CHECK(t.device() == ref.device(), op, ": expected ", name, " on device ", ref.device(), " (the device of ",
           ref_name, "), got ", t.device());
}

inline void check_cpu(const char* op, const char* name, const at::Tensor& t) {
  HS_CHECK(t.device().is_cpu(), op, ": expected ", name, " on the CPU, got ", t.device());
}

inline void check_cuda(const char* op, const char* name, const at::Tensor& t) {
  HS_CHECK(t.device().is_cuda(), op, ": expected ", name, " on a CUDA device, got ", t.device());
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  HS_CHECK(t.is_contiguous(), op, ": expected ", name, " to be contiguous, got strides ", t.strides());
}

}  // namespace heterospec
