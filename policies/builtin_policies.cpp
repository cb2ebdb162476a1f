#include "policies/builtin_policies.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "csrc/core/name_scope.h"
#include "csrc/core/op_name.h"

namespace torch_sac::policies {
namespace {

class ConstantPolicy final : public OpPolicy {
 public:
  explicit ConstantPolicy(Policy decision) : decision_(decision) {}
  Policy decide(const OpCall&) override {
    return decision_;
  }
  bool needs_values() const override {
    return false;
  }
  std::string describe() const override {
    return decision_ == Policy::PreferSave ? "save_all()" : "recompute_all()";
  }

 private:
  Policy decision_;
};

// One decision for the listed ops, PREFER_RECOMPUTE for the rest.
class OpListPolicy final : public OpPolicy {
 public:
  OpListPolicy(const std::vector<OpPattern>& ops, Policy listed, std::string label)
      : matcher_(ops), listed_(listed), label_(std::move(label)) {}
  Policy decide(const OpCall& call) override {
    return matcher_.matches(call.op.operator_name()) ? listed_ : Policy::PreferRecompute;
  }
  bool needs_values() const override {
    return false;
  }
  std::string describe() const override {
    if (!label_.empty()) {
      return label_;
    }
    return (is_offload(listed_) ? "offload_ops(" : "save_ops(") + matcher_.describe() + ")";
  }

 private:
  OpMatcher matcher_;
  Policy listed_;
  std::string label_;
};

class EveryNthPolicy final : public OpPolicy {
 public:
  EveryNthPolicy(const std::vector<OpPattern>& ops, int64_t n) : matcher_(ops), n_(n) {}
  Policy decide(const OpCall& call) override {
    const bool save = matcher_.matches(call.op.operator_name()) && call.call_index % n_ == 0;
    return save ? Policy::MustSave : Policy::PreferRecompute;
  }
  bool needs_values() const override {
    return false;
  }
  std::string describe() const override {
    return "every_nth(" + matcher_.describe() + ", n=" + std::to_string(n_) + ")";
  }
  bool needs_call_index() const override {
    return true;
  }

 private:
  OpMatcher matcher_;
  int64_t n_;
};

// Ops a scope-based policy must not save although they run in a listed scope:
// - random ops: recompute re-runs the region from the restored RNG state, so
//   a random op that is skipped (served from the cache) shifts the RNG stream
//   of every random op recomputed after it, silently changing their values;
// - ops that write to an argument (in-place, out=): autograd bumps the
//   version counter of the written tensor only after the op returns to it,
//   so the cached output would always look mutated after caching (PyTorch's
//   SAC has the same property), and whatever produced the tensor must be
//   re-run anyway;
// - uninitialized allocations (empty*): their output is filled in place by
//   the next ops, so a cached entry would always be a mutated one, and
//   saving it saves no compute.
bool never_saved_in_scope(const c10::OperatorHandle& op) {
  static const OpMatcher allocations({
      {"aten::empty", std::nullopt},
      {"aten::empty_like", std::nullopt},
      {"aten::empty_strided", std::nullopt},
      {"aten::empty_permuted", std::nullopt},
      {"aten::new_empty", std::nullopt},
      {"aten::new_empty_strided", std::nullopt},
  });
  return op.hasTag(at::Tag::nondeterministic_seeded) || op.schema().is_mutable() ||
      allocations.matches(op.operator_name());
}

class SaveByNamePolicy final : public OpPolicy {
 public:
  explicit SaveByNamePolicy(const std::vector<std::string>& names) {
    for (const auto& name : names) {
      const NameId id = intern_name(name);
      if (static_cast<size_t>(id) >= listed_.size()) {
        listed_.resize(id + 1, false);
      }
      if (!listed_[id]) {
        listed_[id] = true;
        names_.push_back(name);
      }
    }
  }
  Policy decide(const OpCall& call) override {
    for (const NameId id : active_names()) {
      if (static_cast<size_t>(id) < listed_.size() && listed_[id]) {
        return never_saved_in_scope(call.op) ? Policy::PreferRecompute : Policy::MustSave;
      }
    }
    return Policy::PreferRecompute;
  }
  bool needs_values() const override {
    return false;
  }
  std::string describe() const override {
    std::string out = "save_by_name(";
    const char* sep = "";
    for (const auto& name : names_) {
      out += sep;
      out += "'" + name + "'";
      sep = ", ";
    }
    return out + ")";
  }

 private:
  std::vector<bool> listed_;       // by NameId
  std::vector<std::string> names_; // in the order given, without repeats
};

} // namespace

OpMatcher::OpMatcher(const std::vector<OpPattern>& patterns) {
  for (const auto& p : patterns) {
    TORCH_CHECK_VALUE(
        p.name.find("::") != std::string::npos, "torch_sac: op name '", p.name,
        "' must be qualified with its namespace, e.g. 'aten::mm'");
    if (p.overload) {
      overloads_.insert(c10::OperatorName(p.name, *p.overload));
    } else {
      packets_.insert(p.name);
    }
  }
}

bool OpMatcher::matches(const c10::OperatorName& op) const {
  return (!overloads_.empty() && overloads_.count(op)) ||
      (!packets_.empty() && packets_.count(op.name));
}

std::string OpMatcher::describe() const {
  std::ostringstream out;
  out << "[";
  const char* sep = "";
  for (const auto& name : packets_) {
    out << sep << name;
    sep = ", ";
  }
  for (const auto& op : overloads_) {
    out << sep << op_display_name(op);
    sep = ", ";
  }
  out << "]";
  return out.str();
}

std::shared_ptr<OpPolicy> save_ops(const std::vector<OpPattern>& ops) {
  return std::make_shared<OpListPolicy>(ops, Policy::MustSave, "");
}

std::shared_ptr<OpPolicy> offload_ops(const std::vector<OpPattern>& ops) {
  return std::make_shared<OpListPolicy>(ops, Policy::PreferOffload, "");
}

std::shared_ptr<OpPolicy> save_all() {
  return std::make_shared<ConstantPolicy>(Policy::PreferSave);
}

std::shared_ptr<OpPolicy> recompute_all() {
  return std::make_shared<ConstantPolicy>(Policy::PreferRecompute);
}

const std::vector<OpPattern>& matmul_ops() {
  // Every matmul-class op of torch 2.11 to 2.15 that autograd sees, so that
  // a region or a SAC mode meets it (composite ops such as linear, matmul,
  // conv2d or scaled_dot_product_attention decompose into these). In-place
  // and out= variants (addmm_, _flash_attention_forward_no_dropout_inplace)
  // are left out: an op that writes to an argument is recomputed whatever
  // the policy says. Names, not handles: an op missing
  // from one release (_scaled_addmm is new in 2.15) or registered by a
  // library loaded later (flash-attn) matches once it exists.
  // tests/python/test_policy_library.py fails when a release adds an op of
  // this kind that is not listed here.
  static const std::vector<OpPattern> ops = [] {
    std::vector<OpPattern> patterns;
    for (const char* name : {
             // Dense, batched, grouped (MoE experts), fused-epilogue.
             "aten::mm",
             "aten::addmm",
             "aten::bmm",
             "aten::baddbmm",
             "aten::addbmm",
             "aten::_addmm_activation",
             "aten::_grouped_mm",
             "aten::_foreach_mm",
             // Low precision and quantized weights (FP8, int8, int4).
             "aten::_scaled_mm",
             "aten::_scaled_mm_v2",
             "aten::_scaled_addmm",
             "aten::_scaled_grouped_mm",
             "aten::_scaled_grouped_mm_v2",
             "aten::_int_mm",
             "aten::_weight_int8pack_mm",
             "aten::_weight_int4pack_mm",
             "aten::_weight_int4pack_mm_for_cpu",
             "aten::_weight_int4pack_mm_with_scales_and_zeros",
             // Sparse operands: 2:4 semi-structured weights, COO/CSR tensors.
             "aten::_cslt_sparse_mm",
             "aten::_sparse_semi_structured_mm",
             "aten::_sparse_semi_structured_addmm",
             "aten::_sparse_addmm",
             "aten::_sparse_mm_reduce_impl",
             "aten::sparse_sampled_addmm",
             "aten::hspmm",
             "aten::sspaddmm",
             // Convolutions: the autograd-level op and each backend's kernel.
             "aten::convolution",
             "aten::_convolution",
             "aten::convolution_overrideable",
             "aten::conv_tbc",
             "aten::mkldnn_convolution",
             "aten::cudnn_convolution",
             "aten::cudnn_convolution_transpose",
             "aten::cudnn_convolution_relu",
             "aten::cudnn_convolution_add_relu",
             "aten::miopen_convolution",
             "aten::miopen_convolution_transpose",
             "aten::miopen_depthwise_convolution",
             "aten::miopen_convolution_relu",
             "aten::miopen_convolution_add_relu",
             "aten::_mps_convolution",
             "aten::_mps_convolution_transpose",
             "aten::_nnpack_spatial_convolution",
             "aten::_slow_conv2d_forward",
             "aten::slow_conv3d_forward",
             "aten::slow_conv_dilated2d",
             "aten::slow_conv_dilated3d",
             "aten::slow_conv_transpose2d",
             "aten::slow_conv_transpose3d",
             "aten::_conv_depthwise2d",
             "aten::conv_depthwise3d",
             // Attention: the SDPA kernels (CPU, flash, efficient, cuDNN, others'
             // backends), their lower-level forwards, fused MHA.
             "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_cudnn_attention",
             "aten::_scaled_dot_product_fused_attention_overrideable",
             "aten::_scaled_dot_product_attention_math_for_mps",
             "aten::_flash_attention_forward",
             "aten::_efficient_attention_forward",
             "aten::_cudnn_attention_forward",
             "aten::_native_multi_head_attention",
             "aten::_triton_multi_head_attention",
             "aten::_triton_scaled_dot_attention",
             // flash-attn 2 and 3's custom ops, when the library is loaded.
             "flash_attn::_flash_attn_forward",
             "flash_attn::_flash_attn_varlen_forward",
             "flash_attn_3::fwd",
         }) {
      patterns.push_back({name, std::nullopt});
    }
    return patterns;
  }();
  return ops;
}

std::shared_ptr<OpPolicy> save_matmuls() {
  return std::make_shared<OpListPolicy>(matmul_ops(), Policy::MustSave, "save_matmuls()");
}

std::shared_ptr<OpPolicy> offload_matmuls() {
  return std::make_shared<OpListPolicy>(matmul_ops(), Policy::PreferOffload, "offload_matmuls()");
}

std::shared_ptr<OpPolicy> every_nth(const std::vector<OpPattern>& ops, int64_t n) {
  TORCH_CHECK_VALUE(n >= 1, "torch_sac: every_nth needs n >= 1, got ", n);
  return std::make_shared<EveryNthPolicy>(ops, n);
}

std::shared_ptr<OpPolicy> save_by_name(const std::vector<std::string>& names) {
  return std::make_shared<SaveByNamePolicy>(names);
}

} // namespace torch_sac::policies
