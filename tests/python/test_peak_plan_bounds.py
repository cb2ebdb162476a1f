"""Peak plans at their bounds: the least peak, the number of planning runs,
and the state planning leaves behind.

* The least peak a refusal states is one the planner measured, and
  planning for exactly that peak returns a plan. Recomputing everything
  under a zero budget is not the least peak: its first rebuild replays the
  whole forward from the inputs, and that replay's working set sits on top
  of what backward holds; a plan that keeps a few checkpoints peaks lower.
  Checked on a small Hugging Face Mamba (random weights, no download),
  where the plan between the two has gradients bitwise equal to autograd's.
* Planning calls the step at most ``MAX_PLANNING_RUNS`` times
  (``plan.planning_runs``), counted here by the step itself.
* Planning leaves module buffers (BatchNorm running statistics,
  ``num_batches_tracked``), the RNG state and parameters' ``.grad`` exactly
  as they were, on success, on a refusal and on an error in the step, also
  when the step calls ``backward`` itself.
"""

import copy
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_sac
from helpers import assert_bitwise
from torch_sac.planners.peak_search import MAX_PLANNING_RUNS, _measure
from torch_sac.models import TinyGPT

budget = torch_sac.policies.budget


# One intra-op thread: deterministic CPU kernels, so gradients compare
# bitwise and peaks repeat.
pytestmark = pytest.mark.usefixtures("one_thread")


def counted(fn):
    """fn, and a list that grows by one per call."""
    calls = []

    def step():
        calls.append(1)
        return fn()

    return step, calls


def refusal_least(excinfo):
    """The least peak a refusal states, in bytes."""
    message = str(excinfo.value)
    found = re.search(r"below the least peak [^:]*: (\d+) bytes", message)
    assert found, message
    return int(found.group(1))


def grads(step, leaves, plan=None):
    if plan is None:
        out = step()
    else:
        with torch_sac.sac_context(plan):
            out = step()
    return torch.autograd.grad(out, leaves)


def tiny_gpt_step(seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, dim=64, heads=4, depth=6, dropout=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 64, (4, 64), generator=g)
    targets = tokens.roll(-1, 1)

    def step():
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())

    return model, step


# --------------------------------------------------------------------------
# The least peak
# --------------------------------------------------------------------------


def tiny_mamba():
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.MambaConfig(
        vocab_size=100, hidden_size=64, state_size=8, num_hidden_layers=2
    )
    model = transformers.MambaForCausalLM(config).train()
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))

    def step():
        return model(input_ids=ids, labels=ids).loss

    return model, step


@pytest.mark.slow
def test_mamba_plans_below_recomputing_everything_and_refuses_only_below_a_measured_peak():
    model, step = tiny_mamba()
    leaves = list(model.parameters())
    want = grads(step, leaves)
    recompute_everything = _measure(
        step,
        (),
        {},
        "test",
        torch.device("cpu"),
        torch_sac.policies.recompute_all(),
        torch_sac.ReplayBudget(0, counts_saved=True),
    ).peak

    counted_step, calls = counted(step)
    with pytest.raises(ValueError, match="below the least peak") as refused:
        budget(counted_step, peak_bytes=recompute_everything // 3)
    assert len(calls) <= MAX_PLANNING_RUNS
    least = refusal_least(refused)
    # The old planner stated recompute_everything as the least peak.
    assert least < recompute_everything

    # A peak between the two: a plan that fits, bitwise.
    peak = (least + recompute_everything) // 2
    calls.clear()
    plan = budget(counted_step, peak_bytes=peak)
    assert plan.measured_peak <= peak and plan.recomputed_ops > 0
    assert plan.planning_runs == len(calls) <= MAX_PLANNING_RUNS
    assert_bitwise(grads(step, leaves, plan), want)
    with torch_sac.memory.track() as m:
        grads(step, leaves, plan)
    assert m.peak <= peak

    # Exactly the least peak stated: planning reaches it again.
    at_least = budget(step, peak_bytes=least)
    assert at_least.measured_peak <= least
    assert_bitwise(grads(step, leaves, at_least), want)
    assert all(p.grad is None for p in leaves)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["chain", "gpt"])
def test_the_least_peak_a_refusal_states_is_reached_by_planning_for_it(which):
    if which == "chain":
        torch.manual_seed(0)
        layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(12)])
        x = torch.randn(256, 64, requires_grad=True)

        def step():
            return layers(x).sum()
    else:
        _, step = tiny_gpt_step()
    with pytest.raises(ValueError) as refused:
        budget(step, peak_bytes=1024)
    message = str(refused.value)
    # What was asked, the least measured, what to do.
    assert "peak_bytes=1024 (1.0 KiB) is below the least peak measured here" in message
    least = refusal_least(refused)
    assert f"Plan for peak_bytes >= {least}" in message
    assert "without checkpointing" in message
    plan = budget(step, peak_bytes=least)
    assert plan.measured_peak <= least
    with pytest.raises(ValueError, match=f"least peak measured here: {least} bytes"):
        budget(step, peak_bytes=least - 1)


# --------------------------------------------------------------------------
# Planning runs
# --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.05, 0.25, 0.4, 0.6, 0.9, 2.0])
def test_planning_runs_on_a_transformer_step_are_bounded(fraction):
    _, step = tiny_gpt_step()
    plain = budget(step, peak_bytes=1 << 50).no_checkpoint_peak
    counted_step, calls = counted(step)
    try:
        plan = budget(counted_step, peak_bytes=int(plain * fraction))
    except ValueError as e:
        assert fraction < 0.1 and "below the least peak" in str(e)
        assert len(calls) <= MAX_PLANNING_RUNS
        return
    assert plan.planning_runs == plan.runs == len(calls) <= MAX_PLANNING_RUNS == 10
    assert plan.measured_peak <= plan.peak_bytes
    assert plan.summary()["runs"] == plan.planning_runs
    assert f"{plan.planning_runs} planning runs" in plan.table()
    if fraction > 1:
        assert plan.solver == "none needed" and plan.planning_runs == 2


# --------------------------------------------------------------------------
# State planning leaves behind
# --------------------------------------------------------------------------


class BNNet(nn.Module):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh())
                for _ in range(depth)
            ]
        )

    def forward(self, h):
        for block in self.blocks:
            h = h + F.dropout(block(h), 0.2, training=self.training)
        return h


class Hidden:
    """Holds a model where planning cannot look before it runs (no
    ``__dict__``): its modules are found when their forward runs."""

    __slots__ = ("model",)

    def __init__(self, model):
        self.model = model


def snapshot(model):
    return (
        copy.deepcopy(model.state_dict()),
        torch.get_rng_state(),
        [(p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()],
    )


def assert_as_before(model, before):
    state, rng, grads_before = before
    after = model.state_dict()
    assert after.keys() == state.keys()
    for k in state:
        assert torch.equal(after[k], state[k]), f"{k} changed"
    assert torch.equal(torch.get_rng_state(), rng), "the RNG state changed"
    for i, (p, (grad, values)) in enumerate(zip(model.parameters(), grads_before)):
        assert p.grad is grad, f"parameter {i}: .grad is another tensor"
        if grad is not None:
            assert torch.equal(p.grad, values), f"parameter {i}: .grad changed"


@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("calls_backward", [False, True])
def test_planning_leaves_buffers_rng_and_grads_as_they_were(calls_backward, hidden):
    torch.manual_seed(0)
    model = BNNet()
    x = torch.randn(128, 32)
    # Some gradients from an earlier step, the others None.
    for i, p in enumerate(model.parameters()):
        if i % 3 == 0:
            p.grad = torch.randn_like(p)
    holder = Hidden(model)
    net = (lambda: holder.model) if hidden else (lambda: model)

    def step():
        loss = net()(x).pow(2).mean()
        if calls_backward:
            loss.backward(retain_graph=True)  # accumulates into .grad
        return loss

    # Every run sees the buffers as they were: the same step each time.
    moved = []
    bn = model.blocks[0][1]
    hook = bn.register_forward_hook(lambda m, i, o: moved.append(m.num_batches_tracked.item()))
    torch.manual_seed(3)
    before = snapshot(model)
    peak = budget(step, peak_bytes=1 << 50).no_checkpoint_peak
    assert moved == [1, 1]  # the run without checkpointing, the one saving everything
    assert_as_before(model, before)
    moved.clear()

    # A backward inside the step retains the graph: the region must hold
    # what it rebuilt for the second backward, so little can be dropped.
    plan = budget(step, peak_bytes=int(peak * (0.97 if calls_backward else 0.7)))
    assert moved == [1] * plan.planning_runs
    assert plan.measured_peak <= plan.peak_bytes and plan.recomputed_ops > 0
    assert_as_before(model, before)

    with pytest.raises(ValueError, match="below the least peak"):
        budget(step, peak_bytes=1024)
    assert_as_before(model, before)

    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 3:  # inside a planning region
            raise KeyError("boom")
        return step()

    with pytest.raises(KeyError, match="boom"):
        budget(failing, peak_bytes=int(peak * 0.7))
    assert_as_before(model, before)
    hook.remove()


def test_planned_step_after_planning_matches_a_step_without_planning():
    # BatchNorm statistics and gradients after one planned training step
    # equal those of one un-checkpointed step from the same state: planning
    # itself moved nothing.
    torch.manual_seed(0)
    model = BNNet()
    x = torch.randn(128, 32)
    state0 = copy.deepcopy(model.state_dict())

    def step():
        return model(x).pow(2).mean()

    torch.manual_seed(5)
    with torch_sac.memory.track() as m:
        step().backward()
    want = [p.grad.clone() for p in model.parameters()]
    want_state = copy.deepcopy(model.state_dict())
    model.zero_grad(set_to_none=True)
    model.load_state_dict(state0)

    plan = budget(step, peak_bytes=int(m.peak * 0.7))
    torch.manual_seed(5)
    with torch_sac.sac_context(plan):
        loss = step()
    loss.backward()
    assert_bitwise([p.grad for p in model.parameters()], want)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want_state[k]), k


def test_modules_found_while_running_are_restored_without_changing_the_peaks():
    # A model planning cannot see before the first run (Hidden) has its
    # state saved by a forward pre-hook during that run, into host memory
    # torch does not allocate: the peaks measured are those of the same
    # model in plain sight.
    plans = []
    for hidden in (False, True):
        torch.manual_seed(0)
        model = BNNet()
        x = torch.randn(128, 32)
        holder = Hidden(model)
        net = (lambda: holder.model) if hidden else (lambda: model)

        def step():
            return net()(x).pow(2).mean()

        before = snapshot(model)
        plain = budget(step, peak_bytes=1 << 50).no_checkpoint_peak
        # Over the op chain, whose choices are deterministic (a plan over
        # blocks weighs them by measured time).
        plan = torch_sac.policies.plan_peak(step, peak_bytes=int(plain * 0.7), blocks=None)
        assert_as_before(model, before)
        plans.append((plain, plan.measured_peak, plan.planning_runs, plan.saved))
    assert plans[0] == plans[1]


def test_planning_runs_no_optimizer_step_hooked_on_gradients():
    """Planning runs backward into .grad as a training step does; a hook
    run once a gradient is accumulated (an optimizer step in backward)
    does not run then, and is back afterwards: the weights are as they
    were."""
    model, step = tiny_gpt_step()
    before = [p.detach().clone() for p in model.parameters()]
    steps = []

    def optimizer_step(p):
        steps.append(1)
        with torch.no_grad():
            p.add_(1.0)

    handles = [p.register_post_accumulate_grad_hook(optimizer_step) for p in model.parameters()]
    plain = budget(step, peak_bytes=1 << 50).no_checkpoint_peak
    budget(step, peak_bytes=int(plain * 0.6))
    assert steps == []
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    step().backward()  # the hooks are back
    assert len(steps) == len(before)
    for h in handles:
        h.remove()
