"""`edgerun plan` and `edgerun profile` as a user runs them, and the device-profile schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgerun.cli import build_parser, main
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


@pytest.mark.slow
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


def test_plan_dp_prices_layers_by_multiply_adds_on_request(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """--pricing macs: the plan a batching pipeline gets (its layers priced by their multiply-adds), named in the
    table's head and the JSON; bytes by default."""
    devices = [write(tmp_path, n, device_json(n)) for n in ("a", "b")]
    for pricing in ("bytes", "macs"):
        out = tmp_path / f"{pricing}.json"
        argv = ["plan", "--devices", *map(str, devices), "--plan", "dp", "--objective", "max", "--out", str(out)]
        assert main(argv + (["--pricing", pricing] if pricing == "macs" else [])) == 0
        assert f"(max objective, layers priced by {pricing})" in capsys.readouterr().out
        assert pp_plan_from_json(json.loads(out.read_text())).pricing.value == pricing


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
        captured = capsys.readouterr()
        err = [line for line in captured.err.strip().splitlines() if not line.startswith("master: ")]
        assert len(err) == 1 and "MB" in err[0], err
        assert captured.out == ""  # no partial plan with a predicted time before the error


def test_the_master_is_named_and_can_be_chosen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    devices = [write(tmp_path, n, device_json(n, budget_mb=400)) for n in ("a", "b")]
    assert main(["plan", "--devices", *map(str, devices), "--plan", "even"]) == 0
    captured = capsys.readouterr()
    assert "master: a (the first --devices file; --master-device picks another)" in captured.err
    assert "a, the master, also looks tokens up" in captured.out
    assert main(["plan", "--devices", *map(str, devices), "--plan", "even", "--master-device", "b"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("master: b\n") and "b, the master" in captured.out
    assert main(["plan", "--devices", *map(str, devices), "--master-device", "c"]) == 2
    assert "--master-device 'c' is none of the devices (a, b)" in capsys.readouterr().err


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


def test_plan_warns_when_one_device_alone_is_faster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fast, slow = write(tmp_path, "fast", device_json("fast", speed=50e9)), write(tmp_path, "slow", device_json(
        "slow", speed=0.5e9))
    assert main(["plan", "--devices", str(slow), str(fast), "--plan", "even"]) == 0
    err = capsys.readouterr().err
    assert "warning: this plan is predicted at" in err and "slower than fast alone" in err
    assert main(["plan", "--devices", str(fast), str(write(tmp_path, "twin", device_json("twin", speed=50e9))),
                 "--plan", "halo"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_plan_file_maps_onto_the_nodes_that_joined(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from edgerun.sched.tp_plan import plan_for_members

    paths = [write(tmp_path, n, device_json(n, budget_mb=b)) for n, b in (("me", 60), ("pi-a", 80), ("pi-b", 100))]
    out = tmp_path / "plan.json"
    assert main(["plan", "--devices", *map(str, paths), "--plan", "halo", "--out", str(out)]) == 0
    plan = tp_plan_from_json(json.loads(out.read_text()))
    mapped = plan_for_members(plan, "me", ["pi-b", "pi-a"])  # joined in the other order
    assert mapped.devices == ("master", "pi-b", "pi-a")
    assert mapped.memory_bytes == (plan.memory_bytes[0], plan.memory_bytes[2], plan.memory_bytes[1])
    assert all(m == (p[0], p[2], p[1]) for m, p in zip(mapped.mlp, plan.mlp, strict=True))
    assert mapped.vocab == (plan.vocab[0], plan.vocab[2], plan.vocab[1])
    with pytest.raises(ValueError, match="not joined: pi-b; not in the plan: pi-c"):
        plan_for_members(plan, "me", ["pi-a", "pi-c"])
    with pytest.raises(ValueError, match="no device named 'master'"):
        plan_for_members(plan, "master", ["pi-a", "pi-b"])


def test_master_runs_a_plan_file_over_nodes_named_by_their_profiles(tmp_path: Path) -> None:
    """The whole path: profiles -> `edgerun plan --out` -> `edgerun master --plan-file` with `edgerun node
    --profile` on each node (name, budget and speed from the profile)."""
    paths = [write(tmp_path, n, device_json(n, budget_mb=b)) for n, b in (("me", 200), ("pi-a", 80), ("pi-b", 80))]
    out = tmp_path / "plan.json"
    assert subprocess.run([sys.executable, "-m", "edgerun.cli", "plan", "--devices", *map(str, paths), "--plan",
                           "even", "--out", str(out)], capture_output=True, timeout=120).returncode == 0
    env = {"EDGERUN_KEY": "plan-file"}
    master = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "master", "--plan-file", str(out), "--port", "0",
                               "--host", "127.0.0.1", "--prompt", "The capital of France is", "--max-tokens", "8",
                               "--threads", "1", "--no-advertise"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, **env})
    nodes = []
    try:
        assert master.stderr is not None
        port = None
        for line in master.stderr:
            if "listening on port" in line:
                port = int(line.split("listening on port ")[1].split(";")[0])
                break
        assert port is not None
        nodes = [subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master", f"127.0.0.1:{port}",
                                   "--profile", str(tmp_path / f"{n}.json"), "--threads", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env={**os.environ, **env}) for n in ("pi-b", "pi-a")]
        stdout, stderr = master.communicate(timeout=300)
        assert master.returncode == 0, stderr
        assert "node pi-a joined" in stderr and "node pi-b joined" in stderr
        plan_line = next(line for line in stderr.splitlines() if "plan even:" in line)
        assert "pi-a" in plan_line and "pi-b" in plan_line, plan_line
        assert stdout.strip()
    finally:
        master.kill()
        for node in nodes:
            node.kill()
            node.wait()


def test_one_list_of_plan_names_for_every_command() -> None:
    """--plan's values come from sched.plans: tensor-parallel's planners, dp and moe; each names one cluster kind and
    planner, and back."""
    from edgerun.net.discovery import ClusterKind
    from edgerun.sched.plans import TPStrategy, cluster_plan, plan_name, plan_names

    assert plan_names(*ClusterKind) == ("halo", "minmax", "greedy", "ilp", "galaxy", "even", "dp", "moe")
    assert plan_names(ClusterKind.TP, ClusterKind.PP)[-1] == "dp" and "moe" not in plan_names(ClusterKind.TP)
    assert cluster_plan("dp") == (ClusterKind.PP, TPStrategy.HALO)
    assert cluster_plan("ilp") == (ClusterKind.TP, TPStrategy.ILP)
    for name in plan_names(*ClusterKind):
        assert plan_name(*cluster_plan(name)) == name
    with pytest.raises(ValueError, match=r"unknown plan 'fast'.*halo.*moe"):
        cluster_plan("fast")
    for argv in (["serve"], ["master"], ["plan"], ["bench", "tp"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*argv, "--plan", "fast"])
