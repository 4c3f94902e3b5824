"""`edgerun plan` and `edgerun profile` as a user runs them, and the device-profile schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgerun.cli import main
from edgerun.net.probe import ProbeResponder, measure_link
from edgerun.sched.pp_plan import pp_plan_from_json
from edgerun.sched.profiles import DEVICE_SCHEMA, device_from_json
from edgerun.sched.tp_plan import tp_plan_from_json

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
REFERENCE = sorted(PROFILES.glob("*.json"))


def device_json(name: str, budget_mb: float = 4000.0, speed: float = 5e9, loss: float = 0.0) -> dict:
    return {"schema": DEVICE_SCHEMA, "name": name, "kind": "x86", "cores": 4,
            "compute": {"matmul_gflops": 50.0, "weight_bytes_per_s": speed},
            "memory": {"total_mb": 8000.0, "available_mb": 6000.0, "budget_mb": budget_mb, "bandwidth_gb_s": 10.0},
            "link": {"rtt_ms": 0.5, "up_mbit": 900.0, "down_mbit": 900.0, "loss_rate": loss}}


def write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_reference_profiles_are_valid_and_cite_sources() -> None:
    assert {p.stem for p in REFERENCE} >= {"rpi4-8gb", "rpi5-8gb", "jetson-orin-nano", "jetson-agx-orin",
                                            "desktop-rtx4070ti", "browser-laptop"}
    for path in REFERENCE:
        profile = device_from_json(json.loads(path.read_text()))
        assert profile.name == path.stem
        for key in ("memory.total_mb", "memory.bandwidth_gb_s", "compute.weight_bytes_per_s", "link"):
            assert profile.sources.get(key), f"{path.name} lacks a source for {key}"


@pytest.mark.parametrize("strategy", ["halo", "minmax", "greedy", "ilp", "galaxy", "dp"])
def test_plan_prints_table_and_writes_versioned_json(strategy: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    devices = [write(tmp_path, n, device_json(n, budget_mb=b, speed=s, loss=p))
               for n, b, s, p in (("a", 60, 3e9, 0.0), ("b", 80, 5e9, 0.05), ("c", 200, 1e9, 0.01))]
    out = tmp_path / "plan.json"
    assert main(["plan", "--devices", *map(str, devices), "--plan", strategy, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "ms per token" in table
    data = json.loads(out.read_text())
    if strategy == "dp":
        plan = pp_plan_from_json(data)
        assert plan.complete and plan.stages[0].first_layer == 0 and plan.stages[-1].end_layer == 30
        for stage in plan.stages:
            assert stage.worker in table
    else:
        plan = tp_plan_from_json(data)
        assert data["schema"] == "edgerun.tp-plan/1"
        assert all(m <= b for m, b in zip(plan.memory_bytes, plan.budget_bytes, strict=True))
        for name in ("a", "b", "c"):
            assert name in table


def test_plr_override_puts_the_lossy_device_last(tmp_path: Path) -> None:
    devices = [write(tmp_path, n, device_json(n)) for n in ("a", "b")]
    out = tmp_path / "plan.json"
    # minmax: both devices take units (halo leaves b out of a model this small: its synchronizations cost more).
    assert main(["plan", "--devices", *map(str, devices), "--plan", "minmax", "--plr", "0.2,0.0",
                 "--out", str(out)]) == 0
    plan = tp_plan_from_json(json.loads(out.read_text()))
    # The reliable device b holds priority index 0 (the most important unit) of every layer's MLP.
    assert all(0 in layer[1] and 0 not in layer[0] for layer in plan.mlp)


BAD_PROFILES = {
    "malformed": ("{not json", "not a JSON file"),
    "negative": (dict(device_json("x"), cores=-1), "device.cores"),
    "missing": ({k: v for k, v in device_json("x").items() if k != "memory"}, "memory"),
    "missing_field": (dict(device_json("x"), link={"rtt_ms": 1, "up_mbit": 1, "down_mbit": 1}), "link.loss_rate"),
    "bad_loss": (dict(device_json("x"), link={"rtt_ms": 1, "up_mbit": 1, "down_mbit": 1, "loss_rate": 2}),
                 "link.loss_rate"),
    "schema": (dict(device_json("x"), schema="other/9"), "schema"),
    "string_number": (dict(device_json("x"), compute={"matmul_gflops": "fast", "weight_bytes_per_s": 1e9}),
                      "compute.matmul_gflops"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROFILES))
def test_bad_profile_is_one_clear_line_naming_file_and_field(case: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    content, field = BAD_PROFILES[case]
    path = write(tmp_path, case, content)
    assert main(["plan", "--devices", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgerun: error:")
    assert str(path) in err[0] and field in err[0]


def test_model_larger_than_all_memory_says_how_much_is_missing(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    devices = [write(tmp_path, n, device_json(n, budget_mb=20)) for n in ("a", "b")]
    for strategy in ("halo", "dp"):
        assert main(["plan", "--devices", *map(str, devices), "--plan", strategy]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "MB" in err[0], err


def test_even_split_reports_out_of_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    devices = [write(tmp_path, "big", device_json("big", budget_mb=400)),
               write(tmp_path, "small", device_json("small", budget_mb=40))]
    assert main(["plan", "--devices", *map(str, devices), "--plan", "even"]) == 2
    captured = capsys.readouterr()
    assert "OUT OF MEMORY: small" in captured.out
    assert "small" in captured.err


def test_no_devices_and_missing_file_exit_2(tmp_path: Path) -> None:
    for argv in (["plan", "--devices"], ["plan", "--devices", str(tmp_path / "absent.json")]):
        done = subprocess.run([sys.executable, "-m", "edgerun.cli", *argv], capture_output=True, text=True)
        assert done.returncode == 2
        assert "Traceback" not in done.stderr


def test_link_probe_measures_loopback() -> None:
    responder = ProbeResponder("127.0.0.1").start()
    try:
        m = measure_link("127.0.0.1", responder.port, bursts=1, burst_size=50, transfer_bytes=1 << 20)
    finally:
        responder.close()
    assert m.probes_sent == 50 and m.probes_lost == 0 and m.loss_rate == 0.0
    assert 0 < m.rtt_ms < 100 and m.up_mbit > 0 and m.down_mbit > 0


def test_profile_measures_this_machine(tmp_path: Path) -> None:
    responder = ProbeResponder("127.0.0.1").start()
    out = tmp_path / "me.json"
    try:
        done = subprocess.run([sys.executable, "-m", "edgerun.cli", "profile", "--seconds", "3", "--name", "me",
                               "--master", f"127.0.0.1:{responder.port}", "--memory-budget", "1000",
                               "--out", str(out)], capture_output=True, text=True, timeout=300)
    finally:
        responder.close()
    assert done.returncode == 0, done.stderr
    assert "[5/5]" in done.stderr  # progress is shown
    profile = device_from_json(json.loads(out.read_text()))
    assert profile.name == "me" and profile.memory.budget_mb == 1000
    assert profile.compute.weight_bytes_per_s > 1e6 and profile.compute.matmul_gflops > 0
    assert profile.memory.bandwidth_gb_s > 0 and profile.link.loss_rate == 0.0 and profile.measured_at
    assert profile.compute.layer_ms > 0 and profile.compute.layer_model.endswith(".gguf")
