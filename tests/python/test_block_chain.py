"""Plans over a step's blocks: the chain solver against brute force, the
recipes as points of its space, ``plan_peak`` over Hugging Face models'
blocks (fits, bitwise, saved and loaded) and ``frontier``."""

import contextlib
import re
import dataclasses
import itertools
import math
import random

import pytest
import torch

import torch_sac
from torch_sac.planners.chain import (
    BlockChoice,
    ChainBlock,
    ChainOption,
    PlanInvariantError,
    check_choices,
    model_peak,
    offloaded_bytes,
    segment_seconds,
    solve_chain,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------
# The chain solver
# --------------------------------------------------------------------------


def random_chain(rng, n):
    blocks = []
    for _ in range(n):
        activation = rng.randint(50, 200)
        input_bytes = rng.randint(1, 10)
        full = rng.uniform(1.0, 5.0)
        options = [ChainOption("keep all", activation, 0.0)]
        for k in range(rng.randint(0, 2)):
            kept = rng.randint(input_bytes, activation)
            # What its backward holds: its activations, or less (it keeps
            # part and rebuilds the rest as backward unpacks it).
            in_backward = rng.choice([None, rng.randint(kept, activation)])
            options.append(
                ChainOption(
                    f"opt{k}", kept, full * (1 - kept / activation), in_backward=in_backward
                )
            )
        options.append(ChainOption("input", input_bytes, full))
        blocks.append(ChainBlock(tuple(options), input_bytes, activation, full, rng.randint(0, 20)))
    return blocks


def every_choice(blocks, slowdown=0.0):
    """Every segmentation and option of a small chain: (choices, seconds),
    a segment of ``k`` blocks replaying them ``1 + slowdown * log2(k)``
    times their forward."""
    n = len(blocks)
    for cuts in itertools.product((False, True), repeat=n - 1):
        segments, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                segments.append((start, i - 1))
                start = i
        segments.append((start, n - 1))
        singles = [j for j, e in segments if j == e]
        for picks in itertools.product(*(range(len(blocks[j].options)) for j in singles)):
            pick = dict(zip(singles, picks))
            choices, seconds = [], 0.0
            for j, e in segments:
                if j == e:
                    option = blocks[j].options[pick[j]]
                    choices.append(BlockChoice(option.name, (j, j)))
                    seconds += option.seconds
                else:
                    choices.append(BlockChoice("segment start", (j, e)))
                    choices += [BlockChoice("in segment", (j, e))] * (e - j)
                    seconds += sum(b.full_seconds for b in blocks[j : e + 1]) * (
                        1 + slowdown * math.log2(e - j + 1)
                    )
            yield choices, seconds


@pytest.mark.parametrize("slowdown", [0.0, 0.25])
@pytest.mark.parametrize("seed", range(30))
def test_the_chain_solver_is_optimal_up_to_its_rounding(seed, slowdown):
    rng = random.Random(seed)
    blocks = random_chain(rng, rng.randint(1, 5))
    base, forward_base = rng.randint(0, 100), rng.randint(0, 100)
    everything = list(every_choice(blocks, slowdown))
    peaks = sorted(model_peak(blocks, c, base, forward_base) for c, _ in everything)
    for peak in (peaks[0], peaks[len(peaks) // 2], peaks[-1], peaks[0] - 1):
        solution = solve_chain(blocks, peak, base, forward_base, slowdown=slowdown)
        fitting = [s for c, s in everything if model_peak(blocks, c, base, forward_base) <= peak]
        if solution is None:
            # Nothing fits, or only by less than the rounding (a slot per block).
            room = (peak - base) / 400 * (len(blocks) + 1)
            tight = [
                s for c, s in everything if model_peak(blocks, c, base, forward_base) <= peak - room
            ]
            assert not tight
            continue
        assert solution.peak <= peak
        assert solution.peak == model_peak(blocks, list(solution.choices), base, forward_base)
        assert fitting and solution.seconds >= min(fitting) - 1e-9
        # Within the rounding of the optimum: as good as any choice that
        # fits a slot per block below the peak.
        room = (peak - base) / 400 * (len(blocks) + 1)
        tight = [
            s for c, s in everything if model_peak(blocks, c, base, forward_base) <= peak - room
        ]
        if tight:
            assert solution.seconds <= min(tight) + 1e-9


class _OffloadStep:
    """What solve_blocks reads of a StepBlocks: a random chain whose blocks
    also have options keeping some bytes in host memory."""

    def __init__(self, rng, n):
        from torch_sac.planners.block_options import OffloadModel

        self.chain = []
        for b in random_chain(rng, n):
            offloads = []
            for k in range(rng.randint(1, 2)):
                moved = rng.randint(1, b.activation - b.input_bytes)
                seconds = rng.uniform(0, b.full_seconds)
                offloads.append(ChainOption(f"off{k}", b.activation - moved, seconds, moved))
            self.chain.append(dataclasses.replace(b, options=b.options + tuple(offloads)))
        self.chain_on_device = [
            dataclasses.replace(b, options=tuple(o for o in b.options if not o.offloaded))
            for b in self.chain
        ]
        self.offloadable = sum(max(o.offloaded for o in b.options) for b in self.chain)
        self.segment_slowdown = 0.0
        self.offload = OffloadModel(
            1,
            1,
            overlaps=False,
            prefetch_bytes=rng.choice([0, 20, 100, 400]),
            keep_last_bytes=rng.choice([0, 10, 50, 200]),
        )

    def peak(self, choices, base, forward_base):
        """The modelled peak with what its offloading holds on the device."""
        in_backward, at_end = self.offload.held_bytes(offloaded_bytes(self.chain, choices))
        return model_peak(self.chain, choices, base + in_backward, forward_base + at_end)


@pytest.mark.parametrize("seed", range(40))
def test_offloading_plans_count_what_offloading_holds(seed):
    """solve_blocks over chains with offload options (the prefetch window
    and the last offloaded bytes held on the device, as much as the plan
    offloads): its plan fits with what its own offloading holds, and is
    never slower than the best plan keeping everything on the device."""
    from torch_sac.planners.peak_search import solve_blocks

    rng = random.Random(seed)
    step = _OffloadStep(rng, rng.randint(2, 4))
    base, forward_base = rng.randint(0, 100), rng.randint(0, 100)
    everything = [(c, s, step.peak(c, base, forward_base)) for c, s in every_choice(step.chain)]
    peaks = sorted(p for _, _, p in everything)
    for peak in (peaks[0], peaks[len(peaks) // 4], peaks[len(peaks) // 2], peaks[-1]):
        solution = solve_blocks(step, peak, base, forward_base)
        on_device = solve_chain(step.chain_on_device, peak, base, forward_base)
        if solution is None:
            assert on_device is None
            continue
        assert step.peak(list(solution.choices), base, forward_base) <= peak
        assert on_device is None or solution.seconds <= on_device.seconds


def test_recipes_are_points_of_the_space_and_more_memory_is_never_slower():
    rng = random.Random(7)
    blocks = random_chain(rng, 12)
    per_block = [BlockChoice("input", (j, j)) for j in range(12)]
    keep_all = [BlockChoice("keep all", (j, j)) for j in range(12)]
    segments = []
    for j in range(0, 12, 3):
        segments += [BlockChoice("segment start", (j, j + 2))]
        segments += [BlockChoice("in segment", (j, j + 2))] * 2
    for recipe, seconds in (
        (per_block, sum(b.full_seconds for b in blocks)),
        (keep_all, 0.0),
        (segments, sum(b.full_seconds for b in blocks)),
    ):
        # A little room for the slots' rounding.
        peak = model_peak(blocks, recipe, 1000, 1000) + 12 * 3
        solution = solve_chain(blocks, peak, 1000, 1000)
        assert solution is not None and solution.seconds <= seconds + 1e-9
    last = float("inf")
    for peak in range(model_peak(blocks, per_block, 1000, 1000) + 40, 4000, 50):
        solution = solve_chain(blocks, peak, 1000, 1000)
        assert solution is not None
        assert solution.seconds <= last + 1e-9
        last = solution.seconds


def test_a_segment_is_priced_above_its_blocks_replay_where_it_replays_slower():
    """On a CPU a segment of k blocks costs about 1 + 0.22 log2(k) times the
    same calls replayed block by block (measured: chain.py), so where
    checkpointing each block fits as well, the solver no longer takes the
    segment for the few bytes of inputs it saves; where only the segment
    fits, it still does. The planner sets the slowdown by the step's
    device."""
    # Blocks of 100 bytes of activations, inputs of 10, one option: keep
    # only the input.
    blocks = [ChainBlock((ChainOption("input", 10, 1.0),), 10, 100, 1.0) for _ in range(4)]
    assert segment_seconds(blocks, 0, 3, 0.25) == pytest.approx(4 * 1.5)
    assert segment_seconds(blocks, 1, 2, 0.0) == pytest.approx(2.0)
    per_block = [BlockChoice("input", (j, j)) for j in range(4)]
    segments = [BlockChoice("segment start", (0, 1)), BlockChoice("in segment", (0, 1))]
    segments += [BlockChoice("segment start", (2, 3)), BlockChoice("in segment", (2, 3))]
    # Room for both (250 bytes; the segments need 210 in backward): the
    # same replay without the slowdown, per-block checkpointing with it.
    assert model_peak(blocks, per_block, 0, 0) == 130 and model_peak(blocks, segments, 0, 0) == 210
    assert solve_chain(blocks, 250, 0, 0).seconds == pytest.approx(4.0)
    slowed = solve_chain(blocks, 250, 0, 0, slowdown=0.25)
    assert [c.option for c in slowed.choices] == ["input"] * 4 and slowed.seconds == 4.0
    # Room only for the segments (forward's end holds 200 more: the
    # segments keep two inputs, per-block checkpointing four).
    assert model_peak(blocks, segments, 0, 200) == 220 < model_peak(blocks, per_block, 0, 200)
    only = solve_chain(blocks, 222, 0, 200, slowdown=0.25)
    assert only is not None and only.seconds == pytest.approx(2 * 2 * 1.25)
    assert [c.option for c in only.choices] == [c.option for c in segments]

    # The planner's view of a CPU step prices segments so.
    lin = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
    x = torch.randn(16, 32)

    def step():
        h = x
        for b in lin:
            h = torch.tanh(b(h))
        return h.sum()

    with planner_view(step, list(lin)) as (_, step_blocks, _, _):
        assert step_blocks.segment_slowdown == 0.22


def test_a_segment_peaks_at_the_backward_of_any_of_its_blocks():
    # Gradients larger than the later blocks' activations: the segment's
    # peak is at its first block's backward (its activations rebuilt, every
    # gradient made), not at its last block's (a reviewer's case).
    big = ChainBlock(
        (ChainOption("keep all", 1000, 0.0), ChainOption("input", 10, 1.0)), 10, 1000, 1.0, 1000
    )
    small = ChainBlock(
        (ChainOption("keep all", 10, 0.0), ChainOption("input", 10, 1.0)), 10, 10, 1.0, 1000
    )
    segment = [BlockChoice("segment start", (0, 1)), BlockChoice("in segment", (0, 1))]
    # Block 0's backward: its activations, block 1's gradients and half of
    # its own (made as its activations go).
    assert model_peak([big, small], segment, 0, 0) == 1000 + 1000 + 500
    # Below that no choice fits (block 0's backward holds as much in each).
    assert solve_chain([big, small], 2400, 0, 0) is None
    solution = solve_chain([big, small], 2600, 0, 0)
    assert solution is not None and solution.peak <= 2600


def test_a_block_keeping_part_of_itself_fits_where_its_activations_do_not():
    # Backward holds 400 of the block keeping "part" (100 kept, the rest
    # rebuilt as it is unpacked), against all 1000 of it recomputed.
    block = ChainBlock(
        (
            ChainOption("keep all", 1000, 0.0),
            ChainOption("part", 100, 0.5, in_backward=400),
            ChainOption("input", 10, 1.0),
        ),
        10,
        1000,
        1.0,
        0,
    )
    assert model_peak([block], [BlockChoice("part", (0, 0))], 0, 0) == 400
    assert model_peak([block], [BlockChoice("input", (0, 0))], 0, 0) == 1000
    solution = solve_chain([block], 500, 0, 0)
    assert solution is not None and [c.option for c in solution.choices] == ["part"]
    assert solve_chain([block], 399, 0, 0) is None


def test_nothing_fits_below_the_constant():
    blocks = random_chain(random.Random(1), 3)
    assert solve_chain(blocks, 100, 100, 0) is None
    assert solve_chain(blocks, 100, 0, 200) is None
    assert solve_chain([], 100, 0, 0) is None


# --------------------------------------------------------------------------
# plan_peak over a model's blocks
# --------------------------------------------------------------------------


def hf_model(kind):
    from hf_tiny import VOCAB, gpt2_config, llama_config

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1234)
    if kind == "llama":
        config = llama_config(use_cache=False)
        config.num_hidden_layers = 6
        model = transformers.LlamaForCausalLM(config)
        layers = list(model.model.layers)
    else:  # GPT-2 with its dropouts (0.1)
        config = gpt2_config(use_cache=False)
        config.n_layer = 6
        model = transformers.GPT2LMHeadModel(config)
        layers = list(model.transformer.h)
    model.train()
    # Activations large enough against the gradients for checkpointing to pay.
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(99))
    return model, dict(input_ids=ids, labels=ids), layers


def run_step(model, batch, ctx=None):
    """Loss and every gradient of one step, from RUN_SEED; the peak."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with torch_sac.memory.track() as m:
        if ctx is None:
            loss = model(**batch).loss
        else:
            with ctx:
                loss = model(**batch).loss
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, m.peak


def chained_step(embed, blocks, x):
    """A step: ``embed(x)``, then each of ``blocks`` in turn, summed."""

    def step():
        h = embed(x)
        for block in blocks:
            h = block(h)
        return h.sum()

    return step


@contextlib.contextmanager
def planner_view(step, blocks="auto"):
    """The planner's view of ``step`` as ``plan_peak`` builds it:
    ``(planner, step_blocks, base, forward_base)``, the model's constants
    calibrated on the run without checkpointing; the step's state is put
    back on exit."""
    from torch_sac.planners.chain import kept_bytes
    from torch_sac.planners.peak_search import Planner
    from torch_sac.planners.step_state import StepState

    state = StepState()
    state.find(step, (), {})
    try:
        planner = Planner(step, (), {}, 1 << 40, "test", state, blocks, False)
        plain = planner.plain_run().peak
        step_blocks = planner.step_blocks()
        forward_base = plain - kept_bytes(step_blocks.chain, step_blocks.recipe("keep all"))
        yield planner, step_blocks, forward_base - step_blocks.head_bytes, forward_base
    finally:
        state.restore()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_plan_over_blocks_fits_and_is_bitwise(kind, tmp_path):
    model, batch, layers = hf_model(kind)

    def step():
        return model(**batch).loss

    want_loss, want_grads, _ = run_step(model, batch)
    plain = torch_sac.policies.plan_peak(step, peak_bytes=1 << 40).no_checkpoint_peak
    plan = torch_sac.policies.plan_peak(step, peak_bytes=int(plain * 0.7))
    assert plan.solver == "block chain", plan.table()
    assert plan.measured_peak <= plan.peak_bytes
    assert plan.replay_budget is None and len(plan.blocks) == len(layers)
    assert "blocks: " in plan.table()
    assert plan.planning_runs <= 10
    got_loss, got_grads, _ = run_step(model, batch, torch_sac.sac_context(plan))
    assert torch.equal(got_loss, want_loss)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)
    plan.save(tmp_path / "plan.json")
    loaded = torch_sac.PeakPlan.load(tmp_path / "plan.json")
    assert loaded.blocks == plan.blocks and loaded.to_dict() == plan.to_dict()
    got_loss, got_grads, _ = run_step(model, batch, torch_sac.sac_context(loaded))
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))


class _ConvFront(torch.nn.Module):
    """A block with no matmul reading the step's raw input (no grad):
    wav2vec2's feature encoder layer."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = torch.nn.Conv1d(cin, cout, 5, stride=2)

    def forward(self, x):
        return torch.nn.functional.gelu(self.conv(x))


def _conv_front_step():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        [_ConvFront(1, 8), _ConvFront(8, 8)]
        + [torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh()) for _ in range(3)]
    )
    audio = torch.randn(4, 1, 400)  # does not require grad

    def step():
        h = audio
        for b in blocks[:2]:
            h = b(h)
        h = h.transpose(1, 2)
        h = blocks[2](h)
        for b in blocks[3:]:
            h = b(h[..., :8]) + h
        return h.square().mean()

    return blocks, step


def test_a_block_whose_options_coincide_keeps_its_input_under_every_name():
    """Regression (issue 38): a small block whose input comes from outside
    keeps the same calls under "input" and the smallest knapsack (its
    input is not its to keep); the solver's options were deduplicated under
    the first name,
    so per-block checkpointing's recipe asked for an "input" the block no
    longer listed and plan_peak raised KeyError: (0, 'input') at low peaks."""
    blocks, step = _conv_front_step()
    with planner_view(step, blocks=list(blocks)) as (_, step_blocks, base, forward_base):
        names = step_blocks.option_names(0)
        assert "input" in names and "keep all" in names, names
        # Options keeping the same calls are listed once, under the plain name.
        assert step_blocks.resolve(0, "knapsack 25%") == "input", step_blocks.aliases[0]
        for name in ("matmuls", "knapsack 50%", "knapsack 75%"):
            assert step_blocks.resolve(0, name) in names
        per_block = step_blocks.recipe("input")
        assert model_peak(step_blocks.chain, per_block, base, forward_base) > 0
        assert [c.option for c in per_block] == ["input"] * len(blocks)
        with pytest.raises(PlanInvariantError, match=r"block 0 \(_ConvFront\).*'nope'"):
            step_blocks.resolve(0, "nope")
    want = torch.autograd.grad(step(), list(blocks.parameters()))
    plain = torch_sac.policies.plan_peak(step, peak_bytes=1 << 40, blocks=list(blocks))
    for fraction in (0.6, 0.4, 0.25, 0.1):
        target = int(plain.no_checkpoint_peak * fraction)
        try:
            plan = torch_sac.policies.plan_peak(step, peak_bytes=target, blocks=list(blocks))
        except ValueError as e:
            assert "below the least peak measured" in str(e)
            continue
        assert plan.measured_peak <= target
        with torch_sac.sac_context(plan):
            loss = step()
        got = torch.autograd.grad(loss, list(blocks.parameters()))
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_check_choices_names_the_block_and_the_broken_invariant():
    blocks = [
        ChainBlock((ChainOption("keep all", 10, 0.0), ChainOption("input", 1, 1.0)), 1, 10, 1.0)
        for _ in range(3)
    ]
    good = [BlockChoice("input", (0, 0)), BlockChoice("segment start", (1, 2))]
    good.append(BlockChoice("in segment", (1, 2)))
    check_choices(blocks, good)
    broken = {
        "which it does not offer": [BlockChoice("matmuls", (0, 0))] + good[1:],
        "choices for a chain of 3": good[:2],
        "segments must cover": [good[0], BlockChoice("input", (0, 0)), good[2]],
        "expected 'in segment'": good[:2] + [BlockChoice("keep all", (1, 2))],
    }
    for message, choices in broken.items():
        with pytest.raises(PlanInvariantError, match=message):
            check_choices(blocks, choices)
        with pytest.raises(PlanInvariantError, match="torch_sac planner bug"):
            model_peak(blocks, choices, 0, 0)


def _numbers(line):
    return [int(n) for n in re.findall(r"\b\d+\b", line)]


@pytest.mark.parametrize("fraction", [0.6, 0.35])
def test_a_plan_over_blocks_describes_itself_truthfully(fraction):
    """The plan's text against the plan's own numbers and against a run of
    it: what forward keeps and drops, each block's option, calls kept and
    replays, and the peak against the target. (The CLI once printed
    "nothing dropped" for every plan over blocks, which drop by design.)"""
    model, batch, layers = hf_model("llama")

    def step():
        return model(**batch).loss

    plain = torch_sac.policies.plan_peak(step, peak_bytes=1 << 40)
    assert "nothing dropped" in plain.table() and plain.dropped_ops == 0
    plan = torch_sac.policies.plan_peak(step, peak_bytes=int(plain.no_checkpoint_peak * fraction))
    assert plan.solver == "block chain" and plan.dropped_ops > 0, plan.table()
    text = plan.table()
    lines = text.splitlines()
    assert "nothing dropped" not in text
    assert "under the target" in lines[0] and plan.measured_peak <= plan.peak_bytes
    assert (
        lines[1]
        .strip()
        .startswith(f"forward keeps {plan.kept_ops} of {plan.kept_ops + plan.dropped_ops} op calls")
    )
    assert f"drops {plan.dropped_ops} " in lines[1]
    assert f"backward replays {plan.replayed_ops} op calls" in lines[1]
    # A run of the plan keeps, drops and replays what the plan says.
    torch.manual_seed(0)
    with torch_sac.sac_context(plan) as region:
        loss = step()
    loss.backward()
    model.zero_grad(set_to_none=True)
    stats = region.stats()
    assert (stats["saved_ops"], stats["dropped_ops"], stats["dropped_bytes"]) == (
        plan.kept_ops,
        plan.dropped_ops,
        plan.dropped_bytes,
    )
    assert stats["replayed_ops"] == plan.replayed_ops
    # One row per block, as the plan's blocks; the replays add up.
    rows = plan.block_rows
    assert [r.option for r in rows] == plan.blocks and len(rows) == len(layers)
    start = lines.index(next(x for x in lines if x.strip().startswith("block ")))
    outside = plan.replayed_ops - sum(r.replayed_ops for r in rows)
    assert outside >= 0
    for r, line in zip(rows, lines[start + 1 :]):
        assert r.option in line and f"{r.kept_calls}/{r.calls}" in line
        assert _numbers(line)[-1] == r.replayed_ops and _numbers(line)[0] == r.block
        assert r.kept_bytes + r.offloaded_bytes + r.dropped_bytes >= r.activation_bytes
        if r.option == "keep all":
            assert r.kept_calls == r.calls and r.dropped_bytes == 0
    if outside:
        assert f"outside the blocks: {outside} op replays" in text
    assert any(r.dropped_bytes for r in rows)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_byte_model_is_close_and_conservative_on_hf_models(kind):
    """The chain model's peak against the measured one, for every option
    on every block and for random mixes with segments: at most 8 % under it
    and 15 % over. Measured here: 2 % under to 6 % over for most, once in
    about twenty runs 6.5 % under (GPT-2, "knapsack 50%" on every block: the
    knapsack's choice varies with the op times measured, and the planner's
    runs correct such a miss), and up to 11.5 % over: GPT-2, "knapsack 75%"
    on every block when it keeps the addmm before gelu and one of gelu's
    element-wise calls: rebuilding gelu's output for c_proj's backward, the
    simulation holds gelu's other intermediates (backward unpacks them
    next) on top of the rest; the region holds about four of those 64 KiB
    tensors less (conservative: such a plan fits, with room to spare).
    With one price per call for blocks doing the same work, the blocks
    between the first and the last make the same knapsack choice, so such
    an error is no longer diluted by blocks choosing differently (the bound
    leaves room over it because that choice follows the measured times).
    Before the model knew that a block keeping
    part of itself rebuilds the rest as backward unpacks it, and that the
    next block keeps the call making its input, "matmuls" on every Llama
    block was modelled 12 % over."""
    from test_offload import random_choices

    from torch_sac.schedule import ReplaySchedule

    model, batch, layers = hf_model(kind)

    def step():
        return model(**batch).loss

    with planner_view(step) as (_, blocks, base, forward_base):
        chain = blocks.chain
        plans = [blocks.recipe(o.name) for o in chain[1].options]
        rng = random.Random(0)
        plans += [random_choices(blocks, rng) for _ in range(6)]
        for choices in plans:
            policy = ReplaySchedule([], blocks.saved_calls(choices)).policy()
            _, _, measured = run_step(model, batch, torch_sac.sac_context(policy))
            modelled = model_peak(chain, choices, base, forward_base)
            label = [c.option for c in choices]
            assert measured <= modelled * 1.08, (label, measured, modelled)
            assert modelled <= measured * 1.15, (label, measured, modelled)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_offload_options_on_hf_models_are_bitwise(kind):
    """Every block option with offload, in random mixes with segments, on
    Hugging Face models (the CPU stand-in; priced as on a GPU whose blocks
    hide a few tensors' copies, so the "hidden" options exist too)."""
    import random

    from test_offload import _HidesActivations, _step_blocks, random_choices

    from torch_sac.schedule import ReplaySchedule

    model, batch, layers = hf_model(kind)

    def step():
        return model(**batch).loss

    want_loss, want_grads, _ = run_step(model, batch)
    with torch_sac.offload.using(cpu_stand_in=True, min_bytes=0, keep_last_bytes=0):
        blocks = _step_blocks(step, _HidesActivations(64 << 10))
        rng, seen = random.Random(0), set()
        for _ in range(12):
            choices = random_choices(blocks, rng)
            seen.update(c.option for c in choices)
            offloaded = blocks.offloaded_calls(choices)
            policy = ReplaySchedule([], blocks.saved_calls(choices)).policy(offloaded)
            got_loss, got_grads, _ = run_step(model, batch, torch_sac.sac_context(policy))
            label = [c.option for c in choices]
            assert torch.equal(got_loss, want_loss), label
            assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads)), label
    assert {"offload all", "offloaded input", "keep all + offload hidden"} <= seen, seen


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_no_refusal_at_per_block_checkpointing_peak(kind):
    # GPT-2 in training takes SDPA's math path, whose composite ops differ
    # under the profile's Python mode (add/add_): the plan's calls must be
    # renumbered as the region sees them, or the region keeps mid-block
    # tensors and peaks over torch.utils.checkpoint's per block.
    model, batch, layers = hf_model(kind)

    def step():
        return model(**batch).loss

    def checkpointed(forward, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    import functools

    for layer in layers:
        layer.forward = functools.partial(checkpointed, layer.forward)
    try:
        _, _, per_block_peak = run_step(model, batch)
    finally:
        for layer in layers:
            del layer.forward
    plan = torch_sac.policies.plan_peak(step, peak_bytes=per_block_peak)
    assert plan.measured_peak <= per_block_peak


class _Branches(torch.nn.Module):
    # tanh and exp save their outputs, sin its input (the block's input).
    def forward(self, x):
        return torch.tanh(x) + torch.sin(x) + torch.exp(x)


def test_blocks_doing_the_same_work_are_priced_alike():
    """The options are priced by per-call times pooled over the blocks that
    ran the same calls (the median of each call's times over them): one
    profiled forward times each call on its own, so without it a slow
    stretch of the machine made one block's options look dearer than its
    twins' (up to 40 % on the bench's Llama) and decided where the solver
    put the dearer options. Blocks of another width keep their own times;
    calls outside the blocks keep theirs."""
    import statistics

    narrow = [
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
        for _ in range(4)
    ]
    wide = [
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
        for _ in range(2)
    ]
    blocks = [narrow[0], wide[0], narrow[1], narrow[2], wide[1], narrow[3]]
    step = chained_step(torch.nn.Linear(64, 64), blocks, torch.randn(64, 64))
    with planner_view(step, blocks) as (_, step_blocks, _, _):
        records, spans = step_blocks.profile.records, step_blocks.spans
        seconds = step_blocks.seconds
        for group in ([0, 2, 3, 5], [1, 4]):
            chains = [step_blocks.chain[j] for j in group]
            assert len({b.full_seconds for b in chains}) == 1, [b.full_seconds for b in chains]
            first = spans[group[0]]
            for k in range(first.end - first.start):
                raw = [records[spans[j].start + k].seconds for j in group]
                assert seconds[first.start + k] == statistics.median(raw)
        # Blocks between others of the same width (inputs of one size,
        # outputs the next block reads) get the same options.
        assert step_blocks.chain[2].options == step_blocks.chain[3].options
        assert step_blocks.chain[1].options == step_blocks.chain[4].options
        for i in step_blocks.outside:
            assert seconds[i] == records[i].seconds


def test_a_block_rebuilt_from_its_input_holds_one_branch_at_a_time():
    """Backward unpacks exp's output, then tanh's: rebuilt at its unpack,
    each is freed once its node ran, so a block keeping only its input
    holds one of them at a time, not both (its activations)."""
    from torch_sac.schedule import ReplaySchedule

    blocks = torch.nn.ModuleList([_Branches(), _Branches()])
    step = chained_step(torch.nn.Linear(64, 64), blocks, torch.randn(32, 64))

    unit = 32 * 64 * 4
    with planner_view(step, list(blocks)) as (planner, step_blocks, base, forward_base):
        last = step_blocks.chain[1]
        assert last.input_bytes == unit and last.activation == 3 * unit
        input_only = next(o for o in last.options if o.kept == last.input_bytes)
        assert input_only.in_backward == 2 * unit
        assert last.rebuilt == 2 * unit
        keep_all = next(o for o in last.options if o.name == "keep all")
        assert keep_all.in_backward == last.activation
        # Measured: the model (input, one branch, the constants) is not under.
        choices = step_blocks.recipe(input_only.name)
        run = planner.run(ReplaySchedule([], step_blocks.saved_calls(choices)).policy())
    assert run.peak <= model_peak(step_blocks.chain, choices, base, forward_base)


class _SquareTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        z = torch.tanh(x * x)
        ctx.save_for_backward(x, z)
        return z

    @staticmethod
    def backward(ctx, g):
        x, z = ctx.saved_tensors
        return g * (1 - z * z) * 2 * x


class _OddBlock(torch.nn.Module):
    """Blocks the byte model finds hard (a reviewer's): in-place ReLU and
    dropout through views, a custom Function, top-1 routing over experts
    (nonzero, index_add), a second input, a Linear shared by every block."""

    def __init__(self, kind, shared=None, width=64):
        super().__init__()
        nn = torch.nn
        self.kind = kind
        self.a = shared if kind == "tied" else nn.Linear(width, 4 * width)
        self.b = nn.Linear(4 * width, width)
        if kind == "routed":
            self.gate = nn.Linear(width, 4)
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                for _ in range(4)
            )
        if kind == "two inputs":
            self.c = nn.Linear(width, width)

    def forward(self, x, aux=None):
        F = torch.nn.functional
        if self.kind == "in-place":
            h = F.relu(self.a(x), inplace=True)
            h = h.view(*x.shape[:2], 4, -1).transpose(2, 3).reshape(*x.shape[:2], -1)
            return x + self.b(F.dropout(h, 0.2, self.training, inplace=True))
        if self.kind == "custom Function":
            return x + self.b(_SquareTanh.apply(self.a(x)))
        if self.kind == "routed":
            flat = x.reshape(-1, x.shape[-1])
            weight, expert = torch.softmax(self.gate(flat), -1).topk(1, -1)
            out = torch.zeros_like(flat)
            for k, e in enumerate(self.experts):
                rows = (expert[:, 0] == k).nonzero().squeeze(-1)
                out = out.index_add(0, rows, e(flat[rows]) * weight[rows])
            return x + out.view_as(x)
        if self.kind == "two inputs":
            return x + self.b(torch.relu(self.a(x))) * torch.sigmoid(self.c(aux))
        return x + self.b(torch.relu(self.a(x)))  # tied


class _OddNet(torch.nn.Module):
    def __init__(self, kind, n=6, width=64):
        super().__init__()
        self.embed = torch.nn.Linear(16, width)
        shared = torch.nn.Linear(width, 4 * width)
        self.layers = torch.nn.ModuleList(_OddBlock(kind, shared) for _ in range(n))
        self.head = torch.nn.Linear(width, 16)

    def forward(self, inputs):
        x = self.embed(inputs)
        aux = x.detach() * 0.5 + 1
        for layer in self.layers:
            x = layer(x, aux)
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("kind", ["in-place", "custom Function", "routed", "two inputs", "tied"])
def test_plans_over_blocks_the_model_finds_hard_fit_and_are_bitwise(kind):
    # Where the byte model is off (up to 44 % under on the in-place blocks,
    # 14 % on the routed ones), the planner's measured runs still make every
    # plan it returns fit, within its run limit.
    torch.manual_seed(1234)
    model = _OddNet(kind).train()
    inputs = torch.randn(8, 64, 16, generator=torch.Generator().manual_seed(5))

    def run(ctx=None):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with ctx or contextlib.nullcontext():
            loss = model(inputs)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    want_loss, want_grads = run()
    step = lambda: model(inputs)  # noqa: E731
    plain = torch_sac.policies.plan_peak(step, peak_bytes=1 << 40).no_checkpoint_peak
    for fraction in (0.45, 0.75):
        plan = torch_sac.policies.plan_peak(step, peak_bytes=int(plain * fraction))
        assert plan.measured_peak <= plan.peak_bytes and plan.planning_runs <= 10
        got_loss, got_grads = run(torch_sac.sac_context(plan))
        assert torch.equal(got_loss, want_loss)
        assert len(got_grads) == len(want_grads)
        assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads)), (kind, fraction)


def test_blocks_none_plans_the_op_chain_and_bad_blocks_raise():
    model, batch, layers = hf_model("llama")

    def step():
        return model(**batch).loss

    plain = torch_sac.policies.plan_peak(step, peak_bytes=1 << 40).no_checkpoint_peak
    plan = torch_sac.policies.plan_peak(step, peak_bytes=int(plain * 0.7), blocks=None)
    assert plan.solver != "block chain" and plan.blocks is None
    explicit = torch_sac.policies.plan_peak(step, peak_bytes=int(plain * 0.7), blocks=layers)
    assert explicit.solver == "block chain"
    with pytest.raises(TypeError, match="blocks must be"):
        torch_sac.policies.plan_peak(step, peak_bytes=plain, blocks=layers[0])
    with pytest.raises(ValueError, match="two or more distinct modules"):
        torch_sac.policies.plan_peak(step, peak_bytes=plain, blocks=[layers[0], layers[0]])
    with pytest.raises(ValueError, match="not an nn.Module"):
        torch_sac.policies.plan_peak(step, peak_bytes=plain, blocks=[layers[0], 3])


def test_explicit_blocks_that_are_not_a_chain_raise():
    model, batch, layers = hf_model("llama")

    def step():
        return model(**batch).loss

    plain = torch_sac.policies.plan_peak(step, peak_bytes=1 << 40).no_checkpoint_peak
    other, _, other_layers = hf_model("llama")  # never called by the step
    for blocks in (other_layers, layers[::-1]):
        with pytest.raises(ValueError, match="cannot be planned as a chain"):
            torch_sac.policies.plan_peak(step, peak_bytes=int(plain * 0.7), blocks=blocks)
    assert all(p.grad is None for p in model.parameters())


def test_block_runs_reads_as_runs():
    from torch_sac.planners.peak_plan import block_runs

    blocks = ["input", "input", "matmuls", "segment start", "in segment"]
    blocks += ["segment start", "in segment", "in segment", "keep all"]
    assert block_runs(blocks) == "0-1 input, 2 matmuls, 3-4 segment, 5-7 segment, 8 keep all"


def test_blocks_called_twice_fall_back_to_the_op_chain():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
    x = torch.randn(256, 64)

    def step():
        h = x
        for _ in range(2):  # each block runs twice: not a chain of blocks
            for b in blocks:
                h = torch.tanh(b(h))
        return h.sum()

    plain = torch_sac.policies.plan_peak(step, peak_bytes=1 << 40).no_checkpoint_peak
    plan = torch_sac.policies.plan_peak(step, peak_bytes=int(plain * 0.6))
    assert plan.solver != "block chain"


# --------------------------------------------------------------------------
# frontier
# --------------------------------------------------------------------------


def test_frontier_measures_plans_and_recipes(tmp_path):
    model, batch, layers = hf_model("llama")

    def step():
        return model(**batch).loss

    before = [p.detach().clone() for p in model.parameters()]
    f = torch_sac.policies.frontier(step, fractions=(0.8, 0.5), rounds=1)
    labels = [p.label for p in f.points]
    assert labels[0] == "no checkpointing"
    for recipe in (
        "checkpoint per block",
        "checkpoint every 2nd block",
        "PyTorch SAC matmuls per block",
        "torch_sac save_matmuls per block",
    ):
        assert recipe in labels
    plans = [p for p in f.points if p.kind == "plan"]
    assert plans and all(p.peak <= p.target for p in plans)
    # Plans over the blocks say each block's option (plan_peak's multiple
    # recomputation, where the blocks do not reach, has none).
    assert any(p.blocks for p in plans)
    assert all(len(p.blocks) == len(layers) for p in plans if p.blocks is not None)
    # Every target has its plan, also where two targets got the same one
    # (measured once, under the first target's label).
    for label in ["plan @ 0.80x", "plan @ 0.50x"] + [
        f"plan @ {p.label}" for p in f.points if p.kind == "recipe"
    ]:
        plan = f.plan_for(label)
        assert plan is not None and plan.kind == "plan", label
    assert f.plan_for("plan @ nothing asked") is None
    front = f.pareto()
    assert [p.peak for p in front] == sorted(p.peak for p in front)
    assert all(a.seconds > b.seconds for a, b in zip(front, front[1:]))
    assert "no checkpointing" in f.table()
    # The model is left as it was, patched forwards removed.
    assert all("forward" not in vars(layer) for layer in layers)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    pytest.importorskip("matplotlib")
    path = f.plot(str(tmp_path / "frontier.png"))
    assert (tmp_path / "frontier.png").stat().st_size > 1000 and path.endswith(".png")


def test_frontier_puts_back_forwards_set_before_it():
    model, batch, layers = hf_model("llama")

    def step():
        return model(**batch).loss

    handle = torch_sac.apply_sac(model, torch_sac.policies.save_matmuls())
    wrapped = [vars(layer)["forward"] for layer in layers]
    torch_sac.policies.frontier(step, fractions=(0.7,), rounds=1, recipes=True)
    assert [vars(layer).get("forward") for layer in layers] == wrapped
    handle.remove()
    assert all("forward" not in vars(layer) for layer in layers)


def test_frontier_needs_blocks():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="cannot be planned over blocks"):
        torch_sac.policies.frontier(lambda: lin(x).sum(), rounds=1)
    with pytest.raises(ValueError, match="fractions"):
        torch_sac.policies.frontier(lambda: lin(x).sum(), fractions=(1.5,))
    with pytest.raises(ValueError, match="rounds"):
        torch_sac.policies.frontier(lambda: lin(x).sum(), rounds=0)


def test_frontier_compares_points_round_by_round():
    """Frontier.ratio: per round one point's time over another's, the
    median, and an interval of order statistics covering the median at
    least 90 % of the time (with 9 rounds the 2nd and 8th ratios, 96 %;
    with 5 all of them, 94 %)."""
    from torch_sac.policies import Frontier, FrontierPoint

    none = FrontierPoint("no checkpointing", "none")
    recipe = FrontierPoint("checkpoint per block", "recipe")
    plan = FrontierPoint("plan @ checkpoint per block", "plan", target=10)
    for p, peak in ((none, 100), (recipe, 40), (plan, 40)):
        p.peak = peak
    # The machine slows down in rounds 3 and 7: both points of those rounds.
    slow = [1.0, 1.0, 1.5, 1.0, 1.0, 1.0, 1.6, 1.0, 1.0]
    none.times = [0.30 * s for s in slow]
    recipe.times = [0.40 * s for s in slow]
    plan.times = [0.38 * s * (1 + 0.01 * k) for k, s in enumerate(slow)]
    f = Frontier([none, recipe, plan], rounds=9)
    r = f.ratio(plan, "checkpoint per block")
    ratios = sorted(0.95 * (1 + 0.01 * k) for k in range(9))
    assert r.median == pytest.approx(ratios[4])
    assert (r.low, r.high) == pytest.approx((ratios[1], ratios[7]))
    assert r.rounds == 9 and r.confidence == pytest.approx(1 - 2 * 10 / 512)
    assert str(r) == f"{r.median:.3f} [{r.low:.3f}, {r.high:.3f}]"
    # Labels as plan_for takes them, and refused or unknown ones.
    assert f.ratio("plan @ checkpoint per block", "no checkpointing") == f.ratio(plan, none)
    assert f.ratio(recipe, none).median == pytest.approx(4 / 3)
    with pytest.raises(KeyError, match="no point 'plan @ 0.10x'"):
        f.ratio("plan @ 0.10x", none)
    table = f.table()
    assert "1.333  1.333-1.333" in table and "96% interval" in table
    recipe.times = recipe.times[:8]
    with pytest.raises(ValueError, match="ran 9 and 8 rounds"):
        f.ratio(plan, recipe)
    for p in (none, recipe, plan):
        p.times = p.times[:5]
    r = f.ratio(plan, recipe)
    assert (r.low, r.high, r.confidence) == pytest.approx((ratios[0], ratios[4], 1 - 2 / 32))


def test_frontier_runs_each_round_in_an_order_of_its_own(monkeypatch):
    """Every round times every point once, and the rounds do not all run
    them in one order (so no point always runs after the same one)."""
    from torch_sac.planners import tradeoff

    model, batch, _ = hf_model("llama")
    ran = []
    run_point = tradeoff._run_point

    def recording(planner, point):
        ran.append(point.label)
        return run_point(planner, point)

    monkeypatch.setattr(tradeoff, "_run_point", recording)
    f = torch_sac.policies.frontier(lambda: model(**batch).loss, fractions=(0.8,), rounds=3)
    n = len(f.points)
    timed = ran[-3 * n :]
    rounds = [timed[k * n : (k + 1) * n] for k in range(3)]
    labels = sorted(p.label for p in f.points)
    assert all(sorted(r) == labels for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1
    assert all(len(p.times) == 3 for p in f.points)


def test_the_frontier_command(tmp_path, capsys):
    from torch_sac import cli

    path = tmp_path / "f.png"
    argv = ["frontier", "--blocks", "3", "--dim", "32", "--seq", "32", "--batch", "2"]
    argv += ["--fractions", "0.7", "--rounds", "1", "--plot", str(path)]
    pytest.importorskip("matplotlib")
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "no checkpointing" in out and "checkpoint per block" in out and "plan @ 0.70x" in out
    assert path.stat().st_size > 1000
    with pytest.raises(SystemExit) as e:
        cli.main(["frontier", "--blocks", "1"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["frontier", "--fractions", "half"])


def test_blocks_found_only_while_the_step_runs():
    # The step reaches the model through an object planning does not look
    # into before the first run: its blocks are found from the modules the
    # run calls.
    model, batch, layers = hf_model("llama")

    class Holder:
        def __init__(self, m):
            self._m = [m]

        def get(self):
            return self._m[0]

    holder = Holder(model)
    hidden = (lambda: holder).__call__

    def step():
        return hidden().get()(**batch).loss

    plain = torch_sac.policies.plan_peak(step, peak_bytes=1 << 40).no_checkpoint_peak
    plan = torch_sac.policies.plan_peak(step, peak_bytes=int(plain * 0.7))
    assert plan.blocks is not None and len(plan.blocks) == len(layers)


def test_apply_sac_takes_a_plan_over_blocks():
    model, batch, layers = hf_model("gpt2")

    def step():
        return model(**batch).loss

    want_loss, want_grads, plain_peak = run_step(model, batch)
    plan = torch_sac.policies.plan_peak(step, peak_bytes=int(plain_peak * 0.7))
    handle = torch_sac.apply_sac(model, plan)
    try:
        assert handle.modules == ["GPT2LMHeadModel"]
        got_loss, got_grads, peak = run_step(model, batch)
        stats = handle.stats()["total"]
    finally:
        handle.remove()
    assert "forward" not in vars(model)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    assert peak <= plan.peak_bytes and stats["dropped_ops"] > 0
    for bad in ({"modules": type(layers[0])}, {"engine": "dropin"}, {"replay_budget": 1 << 20}):
        with pytest.raises(ValueError, match="PeakPlan is for one region"):
            torch_sac.apply_sac(model, plan, **bad)
    assert "forward" not in vars(model)


def test_keeping_every_block_whole_replays_nothing_with_dropout():
    # "keep all" keeps the calls whose outputs are written later too
    # (dropout's empty_like/bernoulli_/div_): a region keeps the storage,
    # so backward draws no mask again (it did, and a plan keeping 6 of 8
    # TinyGPT blocks whole cost 1.19x the step instead of 1.04x).
    from torch_sac.schedule import ReplaySchedule

    model, batch, layers = hf_model("gpt2")

    def step():
        return model(**batch).loss

    with planner_view(step) as (_, blocks, _, _):
        saved = blocks.saved_calls(blocks.recipe("keep all"))
    assert any(op.startswith("aten::bernoulli_") for op, _ in saved)
    want_loss, want_grads, _ = run_step(model, batch)
    region = torch_sac.sac_context(ReplaySchedule([], saved).policy())
    got_loss, got_grads, _ = run_step(model, batch, region)
    assert region.stats()["replayed_ops"] == 0 and region.stats()["dropped_ops"] == 0
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
