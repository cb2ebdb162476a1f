"""torch_sac.apply_sac: one line on a whole model."""

import functools
import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import test_hf_models as hf  # tiny HF builders, Step, assert_step_equal
import torch_sac
from conftest import assert_tensors_equal
from test_hf_models import one_thread  # noqa: F401  (autouse here too: one intra-op thread)
from test_region_memory import storage_bytes
from torch_sac import memory


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
    assert len(handle.modules) == 3 and all(
        isinstance(model.get_submodule(n), Block) for n in handle.modules
    )
    assert list(model.state_dict()) == keys
    assert_same_step(step(model, X), ref, f"apply_sac {engine}")
    stats = handle.stats()
    assert set(stats["per_module"]) == set(handle.modules)
    assert stats["total"]["policy_calls"] == sum(
        s["policy_calls"] for s in stats["per_module"].values()
    )
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
    handle = torch_sac.apply_sac(
        model,
        torch_sac.policies.recompute_all(),
        modules=lambda m: isinstance(m, Block) and m is not model.layers["1"],
    )
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
        torch_sac.apply_sac(
            nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch_sac.policies.recompute_all()
        )
    with pytest.raises(ValueError, match="engine"):
        torch_sac.apply_sac(make(TitanStyle), torch_sac.policies.recompute_all(), engine="nope")
    with pytest.raises(TypeError, match="modules must be"):
        torch_sac.apply_sac(make(TitanStyle), torch_sac.policies.recompute_all(), modules=3)


@pytest.mark.parametrize("engine", ["region", "dropin"])
def test_hugging_face_layers_found(engine):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )

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
        # The refusal names the cache and both fixes.
        with pytest.raises(
            RuntimeError, match="recompute does not match forward: aten::cat"
        ) as err:
            run(model, use_cache=True)
        message = str(err.value)
        assert "grew along dim 2 from 12 to 24" in message, message
        assert "past_key_values" in message and "use_cache=False" in message, message
        assert 'apply_sac(engine="region")' in message, message
    else:
        ref_cached = run(build(), use_cache=True)
        assert_same_step(run(model, use_cache=True), ref_cached, "llama region, use_cache")


@pytest.mark.slow
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


# ==========================================================================
# apply_sac on whole models: Hugging Face GPT-2, BERT and Llama (from tiny
# configs, random weights, dropout on where test_hf_models.py has it) and the
# torchtitan-style ModuleDict model, under both engines and two policies.
#
# Per (model, policy, engine), one step after a warm-up step:
# * loss, every gradient and the global RNG state after the step bitwise
#   equal to the same model without checkpointing (one intra-op thread, as in
#   test_hf_models.py: every kernel these models use is then deterministic);
# * activation memory (torch_sac's counting allocator: bytes live at the end
#   of forward minus before, the outputs' storages aside) at most that of
#   PyTorch's own SAC with the same policy on the same layers
#   (torch.utils.checkpoint(layer_forward, use_reentrant=False,
#   context_fn=partial(create_selective_checkpoint_contexts, policy.to_torch())))
#   and below no checkpointing;
# * remove() puts every layer's own forward back: the next step is exact and
#   keeps exactly the activations of the un-checkpointed run.
# ==========================================================================


def build_titan():
    model = TitanStyle()
    return model, dict(x=X), list(model.layers.values())


def _hf_loss(out):
    return out.loss


def _titan_loss(out):
    return out.square().mean()


# name -> (builder returning (model, batch kwargs, layers), loss of the output)
WHOLE_MODELS = {
    "gpt2": (hf.build_gpt2, _hf_loss),  # SDPA with dropout, dropout on residuals
    "bert": (hf.build_bert, _hf_loss),  # encoder, padding mask, dropout
    "llama": (hf.build_llama, _hf_loss),  # rotary embeddings, GQA, keyword tensors
    "titan": (build_titan, _titan_loss),  # torchtitan's ModuleDict of blocks, dropout
}
WHOLE_POLICIES = {
    "save_matmuls": torch_sac.policies.save_matmuls,
    "recompute_all": torch_sac.policies.recompute_all,
}
ENGINES = ("region", "dropin")


def install_torch_sac(layers, policy):
    """PyTorch's own SAC with ``policy`` on each layer's forward (what
    apply_sac(engine="dropin") does with torch_sac's contexts instead)."""
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy.to_torch())
    for layer in layers:

        def forward(*args, _forward=layer.forward, **kwargs):
            return tc.checkpoint(
                _forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs
            )

        layer.forward = forward


def _output_tensors(out):
    values = out.values() if isinstance(out, dict) else [out]
    return [v for v in values if isinstance(v, torch.Tensor)]


def measured_step(model, batch, loss_fn):
    """One step: loss, gradients and RNG state after it (a hf.Step) and the
    activation bytes of its forward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(hf.RUN_SEED)
    with memory.track() as m:
        out = model(**batch)
        loss = loss_fn(out)
        act = m.delta - storage_bytes(_output_tensors(out) + [loss])
    del out
    loss.backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    return hf.Step(loss.detach().clone(), grads, torch.get_rng_state()), act


def build_whole(name):
    torch.manual_seed(hf.MODEL_SEED)
    model, batch, layers = WHOLE_MODELS[name][0]()
    return model.train(), batch, layers


def run_whole(name, install=None):
    """A fresh model (``install(model, layers)`` applies checkpointing), one
    warm-up step (lazily created state of torch, transformers and the
    engines), then the measured step. Returns (model, batch, layers, step,
    act, what install returned)."""
    model, batch, layers = build_whole(name)
    installed = install(model, layers) if install is not None else None
    loss_fn = WHOLE_MODELS[name][1]
    measured_step(model, batch, loss_fn)
    step, act = measured_step(model, batch, loss_fn)
    return model, batch, layers, step, act, installed


_WHOLE_CACHE = {}


def whole_reference(name):
    """The un-checkpointed step and its activation bytes."""
    key = ("none", name, torch_sac.adapter())
    if key not in _WHOLE_CACHE:
        _, _, _, step, act, _ = run_whole(name)
        _WHOLE_CACHE[key] = step, act
    return _WHOLE_CACHE[key]


def whole_torch_sac(name, policy_name):
    """Activation bytes of PyTorch's SAC with the policy on the same layers
    (its gradients are checked too: the comparison is between exact runs)."""
    key = ("torch", name, policy_name, torch_sac.adapter())
    if key not in _WHOLE_CACHE:
        policy = WHOLE_POLICIES[policy_name]()
        _, _, _, step, act, _ = run_whole(
            name, lambda model, layers: install_torch_sac(layers, policy)
        )
        hf.assert_step_equal(step, whole_reference(name)[0], f"{name}: PyTorch SAC {policy_name}")
        _WHOLE_CACHE[key] = act
    return _WHOLE_CACHE[key]


@pytest.fixture
def gc_paused():
    """No garbage from elsewhere may be freed inside a measured window: the
    cyclic GC is paused for the test (no collection up front: one costs
    ~0.1 s with transformers loaded, and paused it frees nothing anyway)."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


@pytest.mark.usefixtures("gc_paused")
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy_name", list(WHOLE_POLICIES))
@pytest.mark.parametrize("name", list(WHOLE_MODELS))
def test_whole_model_exact_and_at_most_torch_sac_memory(name, policy_name, engine):
    label = f"{name}/{policy_name}/{engine}"
    ref, none_act = whole_reference(name)
    torch_act = whole_torch_sac(name, policy_name)
    keys = []

    def install(model, layers):
        keys.append(list(model.state_dict()))
        return torch_sac.apply_sac(model, WHOLE_POLICIES[policy_name](), engine=engine)

    model, batch, layers, step, act, handle = run_whole(name, install)
    # The blocks found are the model's layers, and nothing was renamed.
    assert [model.get_submodule(n) for n in handle.modules] == layers, handle.modules
    assert list(model.state_dict()) == keys[0]
    hf.assert_step_equal(step, ref, f"apply_sac {label}")
    stats = handle.stats()
    assert set(stats["per_module"]) == set(handle.modules)
    assert stats["total"]["policy_calls"] > 0
    if engine == "region":
        assert stats["total"]["replayed_ops"] > 0, "backward replayed nothing"
    numbers = f"{label}: apply_sac {act} B, PyTorch SAC {torch_act} B, none {none_act} B"
    assert act <= torch_act, numbers
    assert act < none_act, numbers

    handle.remove()
    assert all(
        "forward" not in layer.__dict__ and layer.forward.__func__ is type(layer).forward
        for layer in layers
    )
    assert list(model.state_dict()) == keys[0]
    step, act = measured_step(model, batch, WHOLE_MODELS[name][1])
    hf.assert_step_equal(step, ref, f"{label} after remove()")
    assert act == none_act, f"{label} after remove(): {act} B, un-checkpointed {none_act} B"
    assert handle.stats()["per_module"] == {}
