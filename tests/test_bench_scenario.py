"""Scenario loading: named scenarios, overrides, and errors that name the valid values."""
from __future__ import annotations

import pytest

from bench.scenario import ScenarioError, load_scenario
from bench.systems import get_system, registered_systems


def _tiny(**changes):
    data = {"model": {"family": "gpt", "layers": 2, "hidden": 32, "heads": 4, "vocab": 64},
            "batch": 2, "seq": 8, "systems": ["torch"]}
    data.update(changes)
    return data


def test_named_scenarios_load():
    s = load_scenario("design-s3")
    assert s.model_dims() == {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 32000, "seq": 1024}
    assert (s.batch, s.seq, s.steps, s.warmup, s.dtype) == (8, 1024, 20, 2, "bf16")
    labels = [e.label for e in s.systems]
    assert labels[:5] == ["torch", "torch-amp", "fsdp2-offload", "deepspeed-z2-offload", "deepspeed-z3-offload"]
    assert {"deepspeed-twinflow-0.5", "deepspeed-twinflow-0.2", "deepspeed-zenflow"} <= set(labels)
    zen = s.entry("deepspeed-zenflow")
    eff = s.effective(zen)
    assert eff["steps"] % zen.options["update_interval"] == 0 and eff["loss_after"] == 9
    assert s.effective(s.entry("torch"))["total_steps"] == 22
    short = load_scenario("design-s3", {"steps": 5})  # docs/design.md §3's own 5 steps
    assert short.effective(short.entry("torch"))["total_steps"] == 9  # extra untimed steps to reach loss_after
    assert s.entry("deepspeed-twinflow-0.2").options["ratio"] == 0.2
    assert load_scenario("tiny").dtype == "fp32"
    acc = load_scenario("design-s3-accum8")  # the global batch of 64 x 1024, MemFerry alone capped
    assert (acc.batch, acc.accumulation_steps, acc.model_dims()) == (8, 8, s.model_dims())
    assert [e.label for e in acc.systems] == ["torch", "fsdp2-offload", "deepspeed-z2-offload", "memferry-auto",
                                              "memferry-auto-compiled"]
    assert [acc.effective(e)["device_mem_gb"] for e in acc.systems] == [None, None, None, 17.7, 17.7]
    # the compiled row is the same row with its blocks compiled, nothing else
    plain, compiled = acc.entry("memferry-auto").options, acc.entry("memferry-auto-compiled").options
    assert compiled == {**plain, "compile_blocks": True} and plain["compile_blocks"] is False


def test_overrides_and_selection():
    s = load_scenario("tiny", {"model.layers": 3, "steps": 2, "device_mem_gb": 0.5})
    assert s.model["layers"] == 3 and s.steps == 2 and s.device_mem_gb == 0.5
    sel = s.select(["deepspeed-z3-offload", "torch"])
    assert [e.label for e in sel.systems] == ["deepspeed-z3-offload", "torch"]


def test_period_rounds_steps_to_whole_intervals():
    s = load_scenario(_tiny(steps=5, systems=[{"name": "deepspeed-zenflow", "options": {"update_interval": 4}}]))
    assert s.effective(s.systems[0])["steps"] == 8


@pytest.mark.parametrize("data,match", [
    (_tiny(bacth=2), "valid keys"),
    (_tiny(model={"family": "bert", "layers": 2}), "valid families"),
    (_tiny(systems=["torch", "nonesuch"]), "valid systems: torch"),
    (_tiny(systems=[{"name": "torch", "options": {"precison": "amp"}}]), "valid options: fused, optimizer, precision, recompute"),
    (_tiny(systems=[{"name": "torch", "opts": {}}]), "valid keys"),
    (_tiny(systems=["torch", "torch"]), "appears twice"),
    (_tiny(dtype="fp8"), "valid: auto, fp32, bf16, fp16"),
    (_tiny(steps=0), "positive integer"),
    (_tiny(device_mem_gb=-1), "positive number"),
    (_tiny(max_model={"knob": "width"}), "valid: layers, hidden"),
    (_tiny(systems=[]), "non-empty"),
])
def test_bad_scenarios_name_the_valid_values(data, match):
    with pytest.raises(ScenarioError, match=match):
        load_scenario(data)


def test_select_rejects_unknown_names():
    with pytest.raises(ScenarioError, match="neither a label"):
        load_scenario("tiny").select(["nonesuch"])


def test_missing_scenario_file_lists_named_ones():
    with pytest.raises(ScenarioError, match="design-s3"):
        load_scenario("no-such-scenario")


def test_builtin_systems_registered():
    systems = registered_systems()
    for name in ("torch", "fsdp2-offload", "deepspeed-z2-offload", "deepspeed-z3-offload", "deepspeed-twinflow",
                 "deepspeed-zenflow"):
        assert name in systems
    assert get_system("deepspeed-zenflow").approximate and not get_system("torch").approximate
    with pytest.raises(KeyError, match="valid systems"):
        get_system("nonesuch")


def test_scenario_env_reaches_the_worker_environment(monkeypatch):
    import os

    from bench.scenario import Scenario
    from bench.worker import _prepare_env

    scen = Scenario.from_dict({"model": {"family": "gpt", "layers": 1, "hidden": 32, "heads": 4, "vocab": 16},
                               "systems": ["torch"], "env": {"XPU_TEST_ENV_FLAG": 7}})
    assert scen.env == {"XPU_TEST_ENV_FLAG": "7"}
    monkeypatch.delenv("XPU_TEST_ENV_FLAG", raising=False)
    for key in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "XPU_CPU_DEVICES"):
        monkeypatch.setenv(key, os.environ.get(key, "0"))  # restored after the test
    _prepare_env({"scenario": scen.to_dict()})
    assert os.environ["XPU_TEST_ENV_FLAG"] == "7"
    with pytest.raises(ScenarioError, match="env must map variable names to strings"):
        Scenario.from_dict({"model": {"family": "gpt", "layers": 1, "hidden": 32, "heads": 4, "vocab": 16},
                            "systems": ["torch"], "env": {"A": [1]}})


def test_a_system_s_own_null_cap_lifts_the_scenario_s_and_survives_the_round_trip():
    s = load_scenario(_tiny(device_mem_gb=0.5, systems=[
        "torch", {"name": "torch", "label": "uncapped", "device_mem_gb": None},
        {"name": "torch", "label": "own-cap", "device_mem_gb": 2.0}]))
    caps = {e.label: s.effective(e)["device_mem_gb"] for e in s.systems}
    assert caps == {"torch": 0.5, "uncapped": None, "own-cap": 2.0}
    again = load_scenario(s.to_dict())  # what a worker process reads
    assert {e.label: again.effective(e)["device_mem_gb"] for e in again.systems} == caps
    with pytest.raises(ScenarioError, match="'uncapped' of system 'torch' must be true or false"):
        load_scenario(_tiny(systems=[{"name": "torch", "uncapped": "yes"}]))
