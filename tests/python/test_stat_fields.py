"""Each engine's stats dict has exactly the fields its C++ field list names
(csrc/core/stats.h), in that order, and the drop-in's deprecated aliases
carry the values of the fields they were renamed to."""

import torch
import torch.utils.checkpoint as tc

import torch_sac
from torch_sac import _C

# The drop-in's counters were renamed to the region's words; the old keys
# stay in its dict for one release.
DROPIN_ALIASES = {"recomputed_ops": "replayed_ops", "recompute_ns": "replay_ns"}


def _fields(listing):
    names = [name for name, _ in listing]
    assert len(names) == len(set(names)), names
    for name, description in listing:
        assert isinstance(name, str) and name, name
        assert isinstance(description, str) and description, name
    return names


def _model_step(context_fn):
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def fn(x):
        return torch.mm(torch.mm(x, w).sin(), w).relu()

    out = tc.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    out.sum().backward()


def test_region_stats_keys_are_the_field_list():
    fields = _fields(_C.region_stat_fields())
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as ctx:
        w = torch.randn(8, 8, requires_grad=True)
        y = torch.mm(torch.randn(4, 8), w).sin()
    y.sum().backward()
    stats = ctx.stats()
    assert list(stats) == fields
    assert all(type(v) is int for v in stats.values())
    assert stats["replayed_ops"] > 0


def test_dropin_stats_keys_are_the_field_list_and_aliases_match():
    fields = _fields(_C.dropin_stat_fields())
    descriptions = dict(_C.dropin_stat_fields())
    for alias, field in DROPIN_ALIASES.items():
        assert field in fields and alias in fields
        assert "deprecated" in descriptions[alias] and field in descriptions[alias]
    # The region's words for recompute.
    assert set(DROPIN_ALIASES.values()) <= set(_fields(_C.region_stat_fields()))

    pairs = []

    def context_fn():
        pair = torch_sac.create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
        pairs.append(pair)
        return pair

    _model_step(context_fn)
    assert pairs
    for ctx in pairs[0]:
        stats = ctx.stats()
        assert list(stats) == fields
        assert all(type(v) is int for v in stats.values())
        for alias, field in DROPIN_ALIASES.items():
            assert stats[alias] == stats[field], (alias, stats)
        assert stats["replayed_ops"] > 0
        assert stats["replay_ns"] > 0


def test_docs_tables_are_generated_from_the_field_lists():
    """docs/profiling.md's tables are what scripts/stat_fields_table.py
    prints from the field lists (rerun it with --write after adding one)."""
    import importlib.util

    from conftest import REPO_ROOT

    path = f"{REPO_ROOT}/scripts/stat_fields_table.py"
    spec = importlib.util.spec_from_file_location("stat_fields_table", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    doc = script.DOC.read_text()
    assert script.tables() in doc, "run: python scripts/stat_fields_table.py --write"


def test_profiler_totals_sum_every_counter_but_levels_and_peaks():
    from torch_sac import profiler

    region = _fields(_C.region_stat_fields())
    assert set(profiler._NOT_SUMMED) <= set(region)
    assert list(profiler._REGION_FIELDS) == [n for n in region if n not in profiler._NOT_SUMMED]
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with torch_sac.profile(timeline=False) as prof:
        with torch_sac.sac_context(torch_sac.policies.recompute_all()) as region_ctx:
            out = torch.mm(torch.mm(x, w).sin(), w).relu()
        prof.end_forward()
        out.sum().backward()
    stats = region_ctx.stats()
    for name in profiler._REGION_FIELDS:
        assert prof.totals[name] == stats[name], name
