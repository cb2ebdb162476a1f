"""torch_sac.apply_sac: one line on a whole model."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_sac
from conftest import assert_tensors_equal


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, scale=1.0):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x))))) * scale


class TitanStyle(nn.Module):
    """torchtitan keeps its blocks in a ModuleDict."""

    def __init__(self, n=3, d=16):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.layers = nn.ModuleDict({str(i): Block(d) for i in range(n)})
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers.values():
            h = layer(h, scale=0.5)
        return self.head(h)


def seq_model():
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), Block(), nn.Linear(16, 4))


def make(builder):
    torch.manual_seed(0)
    return builder().train()


def step(model, x):
    torch.manual_seed(1)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_step(a, b, label):
    assert_tensors_equal(a[0], b[0], f"{label}: loss")
    assert a[1].keys() == b[1].keys()
    for n in a[1]:
        assert_tensors_equal(a[1][n], b[1][n], f"{label}: grad of {n}")


X = torch.randn(4, 6, 8)


@pytest.mark.parametrize("engine", ["region", "dropin"])
@pytest.mark.parametrize("builder", [TitanStyle, seq_model], ids=["moduledict", "sequential"])
def test_finds_repeated_blocks_and_is_exact(builder, engine):
    ref = step(make(builder), X)
    model = make(builder)
    keys = list(model.state_dict())
    handle = torch_sac.apply_sac(model, torch_sac.policies.save_matmuls(), engine=engine)
    assert len(handle.modules) == 3 and all(isinstance(model.get_submodule(n), Block)
                                           for n in handle.modules)
    assert list(model.state_dict()) == keys
    assert_same_step(step(model, X), ref, f"apply_sac {engine}")
    stats = handle.stats()
    assert set(stats["per_module"]) == set(handle.modules)
    assert stats["total"]["policy_calls"] == sum(s["policy_calls"] for s in stats["per_module"].values())
    assert stats["total"]["policy_calls"] > 0
    if engine == "region":
        assert stats["total"]["dropped_bytes"] > 0
    assert set(handle.op_details()) == set(handle.modules)


def test_modules_by_class_predicate_and_per_module_policy():
    model = make(TitanStyle)
    seen = []

    def per_module(module):
        seen.append(module)
        return torch_sac.policies.recompute_all()

    handle = torch_sac.apply_sac(model, per_module, modules=nn.Linear)
    # The Linears inside blocks are selected too (no Block is selected).
    assert len(handle.modules) == 2 + 3 * 2 and len(seen) == len(handle.modules)
    handle.remove()
    handle = torch_sac.apply_sac(model, torch_sac.policies.recompute_all(),
                                 modules=lambda m: isinstance(m, Block) and m is not model.layers["1"])
    assert handle.modules == ["layers.0", "layers.2"]
    ref = step(make(TitanStyle), X)
    assert_same_step(step(model, X), ref, "predicate")


def test_eval_no_grad_and_remove():
    model = make(TitanStyle)
    handle = torch_sac.apply_sac(model, torch_sac.policies.recompute_all())
    model.eval()
    model(X)
    with torch.no_grad():
        model.train()
        model(X)
    assert handle.stats()["per_module"] == {}, "recorded in eval mode or under no_grad"
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    step(model, X)
    assert handle.stats()["per_module"] == {}


def test_errors():
    model = make(TitanStyle)
    torch_sac.apply_sac(model, torch_sac.policies.recompute_all())
    with pytest.raises(RuntimeError, match="already checkpointed"):
        torch_sac.apply_sac(model, torch_sac.policies.recompute_all())
    with pytest.raises(ValueError, match="found no repeated blocks"):
        torch_sac.apply_sac(nn.Sequential(nn.Linear(2, 2), nn.ReLU()),
                            torch_sac.policies.recompute_all())
    with pytest.raises(ValueError, match="engine"):
        torch_sac.apply_sac(make(TitanStyle), torch_sac.policies.recompute_all(), engine="nope")
    with pytest.raises(TypeError, match="modules must be"):
        torch_sac.apply_sac(make(TitanStyle), torch_sac.policies.recompute_all(), modules=3)


@pytest.mark.parametrize("engine", ["region", "dropin"])
def test_hugging_face_layers_found(engine):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train()

    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))

    def run(model, use_cache=False):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=use_cache)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = run(build())
    model = build()
    handle = torch_sac.apply_sac(model, torch_sac.policies.save_matmuls(), engine=engine)
    assert handle.modules == ["model.layers.0", "model.layers.1"]
    assert_same_step(run(model), ref, f"llama {engine}")
    if engine == "dropin":
        # With a KV cache the re-run forward attends over the keys the first
        # run cached: 24 positions instead of 12. The drop-in refuses.
        with pytest.raises(RuntimeError, match="recompute does not match forward: aten::cat"):
            run(model, use_cache=True)
    else:
        ref_cached = run(build(), use_cache=True)
        assert_same_step(run(model, use_cache=True), ref_cached, "llama region, use_cache")


def test_under_torch_compile():
    ref = step(make(TitanStyle), X)
    model = make(TitanStyle)
    torch_sac.apply_sac(model, torch_sac.policies.save_matmuls())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    torch.manual_seed(1)
    compiled(X).square().mean().backward()
    torch._dynamo.reset()
    for n, p in model.named_parameters():
        # Compiled kernels may round differently from eager ones.
        torch.testing.assert_close(p.grad, ref[1][n], rtol=1e-5, atol=1e-6)


def test_budget_from_a_real_call_with_apply_sac():
    """budget(model, *args, **kwargs) captures each block's real arguments
    (here a keyword `scale`), plans once per distinct block, and apply_sac
    takes the result; exact, and each block keeps at most its budget."""
    model = make(TitanStyle)
    plan = torch_sac.policies.budget(model, X, fraction=0.5)
    assert isinstance(plan, torch_sac.policies.ModelBudget)
    assert set(plan.plans) == {"layers.0", "layers.1", "layers.2"}
    assert len({id(p) for p in plan.plans.values()}) == 1, "identical blocks share one plan"
    assert plan.saved_bytes <= plan.budget_bytes
    assert "== plan 1 of 1: layers.0-2 (3 blocks, " in plan.table()
    ref = step(make(TitanStyle), X)
    model = make(TitanStyle)
    plan = torch_sac.policies.budget(model, X, fraction=0.5)
    handle = torch_sac.apply_sac(model, plan)
    assert_same_step(step(model, X), ref, "budget + apply_sac")
    for name, stats in handle.stats()["per_module"].items():
        assert stats["saved_bytes"] <= plan.plans[name].budget_bytes, (name, stats)


def test_budget_of_a_single_block_is_unchanged():
    block = Block()
    policy = torch_sac.policies.budget(block, torch.randn(4, 6, 16), fraction=0.5)
    assert isinstance(policy, torch_sac.policies.BudgetPolicy)
