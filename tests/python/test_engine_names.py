"""One vocabulary for the two engines: ``"region"`` and ``"dropin"`` in
``apply_sac(engine=)``, the demo's ``--engine`` and the profiler's
``"engine"`` field, all from ``torch_sac._engines``; profiles written with
the former name (``"sac_context"``, format ``torch_sac.profile/1``) still
load."""

import pytest
import torch
import torch.nn as nn

import torch_sac
from torch_sac import _engines, demo, profiler


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_names():
    assert _engines.ENGINES == ("region", "dropin")
    assert (_engines.REGION, _engines.DROPIN) == _engines.ENGINES


@pytest.mark.parametrize("engine", _engines.ENGINES)
def test_apply_sac_and_the_profiler_say_the_same_name(engine):
    torch.manual_seed(0)
    model = Net()
    handle = torch_sac.apply_sac(model, torch_sac.policies.save_matmuls(), engine=engine)
    try:
        with torch_sac.profile() as prof:
            model(torch.randn(3, 8, requires_grad=True)).sum().backward()
    finally:
        handle.remove()
    data = prof.to_dict()
    assert data["format"] == profiler.FORMAT == "torch_sac.profile/2"
    assert [r["engine"] for r in data["regions"]] == [engine, engine]
    assert f"2 region(s) (engine: 2 {engine})" in prof.table()


def test_apply_sac_refuses_other_names():
    with pytest.raises(ValueError, match=r"engine must be one of \('region', 'dropin'\)"):
        torch_sac.apply_sac(Net(), torch_sac.policies.save_matmuls(), engine="contexts")


def test_a_profile_of_format_1_loads_with_todays_names():
    torch.manual_seed(0)
    model = Net()
    handle = torch_sac.apply_sac(model, torch_sac.policies.save_matmuls())
    try:
        with torch_sac.profile() as prof:
            model(torch.randn(3, 8, requires_grad=True)).sum().backward()
    finally:
        handle.remove()
    today = prof.to_dict()
    old = dict(today, format="torch_sac.profile/1")
    old["regions"] = [dict(r, engine="sac_context") for r in today["regions"]]
    loaded = torch_sac.profile.from_dict(old)
    assert loaded.to_dict() == today
    assert loaded.table() == prof.table()
    assert old["regions"][0]["engine"] == "sac_context"  # the input is not changed
    with pytest.raises(ValueError, match="not a torch_sac.profile/2 dict"):
        torch_sac.profile.from_dict(dict(today, format="torch_sac.profile/0"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, engine", [("region", "region"), ("dropin", "dropin"), ("contexts", "dropin")]
)
def test_demo_engine_flag(flag, engine, capsys):
    """``--engine contexts``, the drop-in's former name, still runs the drop-in."""
    assert demo.main(["--steps", "1", "--engine", flag]) == 0
    out = capsys.readouterr().out
    assert f"engine: {engine}," in out
    assert ("cache hits" in out) == (engine == "dropin")


def test_demo_help_lists_todays_names(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    out = capsys.readouterr().out
    assert "{region,dropin}" in out and "contexts" not in out
