// Selective activation checkpointing in a C++-only (LibTorch) training loop.
//
// A small GPT (token and position embeddings, pre-norm blocks with causal
// self-attention, dropout and an MLP) is trained a few steps with one
// torch_sac region per block, under four policies: recompute_all,
// save_matmuls, a C++ lambda that recomputes only the attention core
// (marked with a NameScope), and a memory-budget plan (policies::budget:
// one block profiled once, the op calls worth the most recompute saved
// within half its activation memory). Each step runs the same model without
// checkpointing on the same batch and dropout seed and checks that every
// gradient is bitwise equal; the exit status is 1 if one differs.
//
// Prints per step: the loss, what the regions kept and dropped, how many ops
// backward replayed, and activation memory (bytes held after forward) and
// peak, measured with torch_sac's counting CPU allocator.
//
//   train_gpt [cpu|cuda]     (default cpu; on cuda the memory columns, which
//                             count CPU allocations, show "-")

#include <torch/torch.h>
#include <torch_sac/torch_sac.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

namespace {

struct Config {
  int64_t vocab = 256;
  int64_t dim = 128;
  int64_t heads = 4;
  int64_t blocks = 4;
  int64_t seq = 64;
  int64_t batch = 4;
  double dropout = 0.1;
  int steps = 3;
};

// The named scope around attention scores, softmax and dropout.
torch_sac::NameId attention_core_scope() {
  static const torch_sac::NameId id = torch_sac::intern_name("attention_core");
  return id;
}

struct CausalSelfAttentionImpl : torch::nn::Module {
  CausalSelfAttentionImpl(const Config& c)
      : heads(c.heads),
        qkv(register_module("qkv", torch::nn::Linear(c.dim, 3 * c.dim))),
        proj(register_module("proj", torch::nn::Linear(c.dim, c.dim))),
        attn_drop(register_module("attn_drop", torch::nn::Dropout(c.dropout))),
        resid_drop(register_module("resid_drop", torch::nn::Dropout(c.dropout))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    auto parts = qkv(x).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4});
    torch::Tensor y;
    {
      // Scores, softmax and attention dropout: large (T x T per head) and
      // cheap to recompute, Megatron's "selective recompute".
      torch_sac::NameScope scope(attention_core_scope());
      auto att = torch::matmul(parts[0], parts[1].transpose(-2, -1)) /
          std::sqrt(static_cast<double>(C / heads));
      const auto mask_options = torch::TensorOptions().dtype(torch::kBool).device(x.device());
      auto future = torch::ones({T, T}, mask_options).triu(1);
      att = att.masked_fill(future, -std::numeric_limits<float>::infinity());
      att = attn_drop(torch::softmax(att, -1));
      y = torch::matmul(att, parts[2]);
    }
    return resid_drop(proj(y.transpose(1, 2).reshape({B, T, C})));
  }

  int64_t heads;
  torch::nn::Linear qkv, proj;
  torch::nn::Dropout attn_drop, resid_drop;
};
TORCH_MODULE(CausalSelfAttention);

struct BlockImpl : torch::nn::Module {
  BlockImpl(const Config& c)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))),
        attn(register_module("attn", CausalSelfAttention(c))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))),
        mlp(register_module(
            "mlp",
            torch::nn::Sequential(
                torch::nn::Linear(c.dim, 4 * c.dim),
                torch::nn::GELU(),
                torch::nn::Linear(4 * c.dim, c.dim),
                torch::nn::Dropout(c.dropout)))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln1(x));
    return x + mlp->forward(ln2(x));
  }

  torch::nn::LayerNorm ln1;
  CausalSelfAttention attn;
  torch::nn::LayerNorm ln2;
  torch::nn::Sequential mlp;
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const Config& c)
      : tok(register_module("tok", torch::nn::Embedding(c.vocab, c.dim))),
        pos(register_parameter("pos", torch::randn({c.seq, c.dim}) * 0.02)),
        drop(register_module("drop", torch::nn::Dropout(c.dropout))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))),
        head(register_module("head", torch::nn::Linear(c.dim, c.vocab))) {
    for (int64_t i = 0; i < c.blocks; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), Block(c)));
    }
  }

  // With a policy, each block runs in its own region; `regions` receives
  // their handles (readable after backward).
  torch::Tensor forward(
      const torch::Tensor& tokens,
      const torch_sac::PolicyPtr& policy,
      std::vector<torch_sac::RegionHandle>* regions) {
    auto x = drop(tok(tokens) + pos.slice(0, 0, tokens.size(1)));
    for (auto& block : blocks) {
      if (policy) {
        torch_sac::SacContext region(policy);
        x = block->forward(x);
        regions->push_back(region.handle());
      } else {
        x = block->forward(x);
      }
    }
    return head(ln_f(x));
  }

  torch::nn::Embedding tok;
  torch::Tensor pos;
  torch::nn::Dropout drop;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(GPT);

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

struct StepResult {
  double loss = 0;
  int64_t activations = 0; // bytes allocated by forward, still held after it
  int64_t peak = 0;        // highest level above the start, forward + backward
};

// One forward and backward on a fixed batch and dropout seed.
StepResult run_step(
    GPT& model,
    const torch::Tensor& tokens,
    const torch::Tensor& targets,
    uint64_t seed,
    const torch_sac::PolicyPtr& policy,
    std::vector<torch_sac::RegionHandle>* regions) {
  torch::manual_seed(seed);
  StepResult r;
  torch_sac::PeakWindow window;
  auto logits = model->forward(tokens, policy, regions);
  r.activations = torch_sac::cpu_memory_stats().allocated - window.start();
  auto loss = torch::nn::functional::cross_entropy(
      logits.view({-1, logits.size(-1)}), targets.view({-1}));
  loss.backward();
  r.peak = window.peak() - window.start();
  r.loss = loss.item<double>();
  return r;
}

// Bitwise comparison of the two models' gradients; prints the first that
// differs.
bool same_gradients(GPT& reference, GPT& checkpointed) {
  auto a = reference->named_parameters();
  auto b = checkpointed->named_parameters();
  for (const auto& item : a) {
    const torch::Tensor& ga = item.value().grad();
    const torch::Tensor& gb = b[item.key()].grad();
    if (!torch::equal(ga, gb)) {
      std::printf(
          "  gradient of %s differs: max |diff| %g\n", item.key().c_str(),
          (ga - gb).abs().max().item<double>());
      return false;
    }
  }
  return true;
}

} // namespace

int main(int argc, char** argv) {
  // Count every tensor allocation from here on (before any thread allocates).
  torch_sac::install_counting_allocator();
  torch::set_num_threads(1); // steady timings on a shared machine; exactness holds for any
  const Config c;
  const torch::Device device(argc > 1 ? argv[1] : "cpu");
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 2;
  }
  const bool counts_memory = device.is_cpu();
  const auto shown = [&](int64_t bytes) { return counts_memory ? mib(bytes) : std::string("-"); };

  // Recompute the attention core, keep everything else: a policy written as
  // a C++ lambda, reading the named scopes open around each op.
  auto attention_core = torch_sac::policies::from_callable(
      [](const torch_sac::OpCall&) {
        const auto names = torch_sac::active_names();
        const bool in_core = std::find(names.begin(), names.end(), attention_core_scope()) !=
            names.end();
        return in_core ? torch_sac::Policy::PreferRecompute : torch_sac::Policy::PreferSave;
      },
      "recompute the attention core");
  // A memory-budget plan: one block profiled once on an input shaped like
  // the real ones; every block has the same structure, so one plan serves
  // them all (the keys are op calls within a region).
  Block sample(c);
  sample->to(device);
  const auto sample_input =
      torch::randn({c.batch, c.seq, c.dim}, torch::TensorOptions().device(device)).requires_grad_();
  const torch_sac::BudgetPlan plan = torch_sac::policies::budget(
      [&] { return sample->forward(sample_input); }, {.fraction = 0.5});
  const std::vector<std::pair<std::string, torch_sac::PolicyPtr>> policies{
      {"recompute_all", torch_sac::policies::recompute_all()},
      {"save_matmuls", torch_sac::policies::save_matmuls()},
      {"attention_core", attention_core},
      {"budget_50%", plan.policy},
  };

  torch::manual_seed(1234);
  const auto tokens = torch::randint(c.vocab, {c.batch, c.seq}, torch::kLong).to(device);
  const auto targets = torch::roll(tokens, -1, 1);

  std::printf(
      "torch_sac %s (torch %s) on %s: GPT %lld blocks, dim %lld, seq %lld, batch %lld, dropout %.1f\n",
      TORCH_SAC_VERSION, TORCH_SAC_TORCH_VERSION, device.str().c_str(),
      static_cast<long long>(c.blocks), static_cast<long long>(c.dim),
      static_cast<long long>(c.seq), static_cast<long long>(c.batch), c.dropout);
  std::printf("budget_50%% plan for one block: %s\n\n", plan.summary().c_str());
  std::printf(
      "%-15s %4s %8s %10s %10s %8s %12s %10s %12s %10s  %s\n", "", "", "", "regions:", "", "",
      "with regions:", "", "without:", "", "");
  std::printf(
      "%-15s %4s %8s %10s %10s %8s %12s %10s %12s %10s  %s\n", "policy", "step", "loss", "kept",
      "dropped", "replayed", "activations", "peak", "activations", "peak", "grads");

  bool all_exact = true;
  for (const auto& [name, policy] : policies) {
    // Two identical models: one trained plainly, one with a region per block.
    torch::manual_seed(0);
    GPT reference(c);
    torch::manual_seed(0);
    GPT checkpointed(c);
    reference->to(device);
    checkpointed->to(device);
    torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3));
    torch::optim::AdamW sac_opt(checkpointed->parameters(), torch::optim::AdamWOptions(1e-3));

    for (int step = 0; step < c.steps; ++step) {
      const uint64_t seed = 100 + step; // the same dropout masks for both
      const StepResult plain = run_step(reference, tokens, targets, seed, nullptr, nullptr);
      std::vector<torch_sac::RegionHandle> regions;
      const StepResult sac = run_step(checkpointed, tokens, targets, seed, policy, &regions);

      torch_sac::RegionStats total;
      for (const auto& region : regions) {
        const torch_sac::RegionStats s = region.stats();
        total.saved_bytes += s.saved_bytes;
        total.dropped_bytes += s.dropped_bytes;
        total.replayed_ops += s.replayed_ops;
      }
      const bool exact = same_gradients(reference, checkpointed) && plain.loss == sac.loss;
      all_exact = all_exact && exact;
      std::printf(
          "%-15s %4d %8.4f %10s %10s %8lld %12s %10s %12s %10s  %s\n", name.c_str(), step, sac.loss,
          mib(total.saved_bytes).c_str(), mib(total.dropped_bytes).c_str(),
          static_cast<long long>(total.replayed_ops), shown(sac.activations).c_str(),
          shown(sac.peak).c_str(), shown(plain.activations).c_str(), shown(plain.peak).c_str(),
          exact ? "bitwise equal" : "DIFFER");

      if (step == c.steps - 1 && name == "save_matmuls") {
        std::printf("  ops of block 0's region, last step:\n");
        for (const auto& op : regions.front().op_details()) {
          std::printf(
              "    %-34s saved %2lld  dropped %2lld  replayed %2lld\n", op.op.c_str(),
              static_cast<long long>(op.saved), static_cast<long long>(op.dropped),
              static_cast<long long>(op.replayed));
        }
      }
      ref_opt.step();
      sac_opt.step();
      ref_opt.zero_grad();
      sac_opt.zero_grad();
    }
  }
  std::printf(
      "\n%s\n",
      all_exact ? "gradients: bitwise equal to training without checkpointing"
                : "gradients: DIFFER from training without checkpointing");
  return all_exact ? 0 : 1;
}
