"""Profiles (JSON round trip, interpolation, refusal of bad files), `inflight plan` on a small profile, and (slow)
`inflight profile` measuring the built-in engine and trainer of a tiny model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from inflight.cli import main
from inflight_plan.profile import DecodeCurve, EngineProfile, Profile, TrainerProfile

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "inflight_plan" / "profiles"


def small_profile() -> Profile:
    return Profile(source="test: a GPU-like curve", notes="made up",
                   engine=EngineProfile(devices=1, max_batch=64,
                                        decode=DecodeCurve(batches=[1, 16, 64], contexts=[32, 512],
                                                           step_s=[[0.010, 0.012, 0.020], [0.011, 0.014, 0.030]]),
                                        prefill_tokens_per_s=20000.0),
                   trainer=TrainerProfile(devices=1, tokens_per_s=5000.0, step_overhead_s=0.1, scaling=0.9),
                   push_s=0.2, pause_s=0.05, overhead_s=0.01)


def test_round_trip(tmp_path):
    p = small_profile()
    path = p.save(tmp_path / "sub" / "p.json")
    assert Profile.load(path) == p
    assert json.loads(path.read_text())["engine"]["decode"]["batches"] == [1, 16, 64]


def test_interpolation_by_hand():
    d = small_profile().engine.decode
    assert d.step_time(16, 32) == pytest.approx(0.012)
    assert d.step_time(40, 32) == pytest.approx(0.012 + (0.020 - 0.012) * 24 / 48)  # between batches
    assert d.step_time(16, 272) == pytest.approx((0.012 + 0.014) / 2)  # halfway in context
    assert d.step_time(128, 32) == pytest.approx(0.020 + (0.020 - 0.012) * 64 / 48)  # past the grid: the last slope
    assert d.step_time(16, 4096) == pytest.approx(0.014)  # context clamped
    t = small_profile().trainer
    assert t.tokens_per_s_at(4) == pytest.approx(5000.0 * 4**0.9)


@pytest.mark.parametrize("change", [
    {"engine": {"decode": {"batches": [16, 1], "contexts": [32], "step_s": [[0.1, 0.1]]}, "prefill_tokens_per_s": 1}},
    {"engine": {"decode": {"batches": [1], "contexts": [32], "step_s": [[0.1, 0.2]]}, "prefill_tokens_per_s": 1}},
    {"engine": {"decode": {"batches": [1], "contexts": [32], "step_s": [[-1.0]]}, "prefill_tokens_per_s": 1}},
    {"push_s": -1},
    {"unknown_field": 3},
])
def test_bad_profiles_are_refused(change):
    data = small_profile().model_dump()
    data.update(change)
    with pytest.raises(ValidationError):
        Profile.model_validate(data)


def test_shipped_profiles_load_and_name_their_sources():
    paths = sorted(PROFILES.glob("*.json"))
    assert paths, "inflight_plan/profiles/ holds the profiles built from public figures"
    for path in paths:
        p = Profile.load(path)
        comment = " ".join(json.loads(path.read_text())["_comment"])
        assert "https://" in comment and "ON PAPER" in p.source  # cited sources; never taken for a measurement


def test_plan_cli_prints_a_split_and_writes_plot_and_json(tmp_path, capsys):
    prof = small_profile().save(tmp_path / "p.json")
    code = main(["plan", str(REPO / "configs" / "cpu-demo.yaml"), "actor.groups_per_step=8", "actor.max_lag=2",
                 "--gpus", "4", "--profile", str(prof), "--lengths", "lognormal:40:0.8:200", "--steps", "8",
                 "--plot", str(tmp_path / "plan.png"), "--json", str(tmp_path / "plan.json"), "--samples", "100000"])
    out = capsys.readouterr().out
    assert code == 0
    assert "PREDICTION" in out and "test: a GPU-like curve" in out
    assert "best split:" in out and "server(s)" in out
    assert "predicted time to 100000 samples: pipelined" in out
    res = json.loads((tmp_path / "plan.json").read_text())
    assert res["prediction"] is True
    pipe = res["setups"]["pipelined"]
    assert pipe["servers"] + pipe["trainer_devices"] == 4 and pipe["servers"] >= 1
    assert max(int(k) for k in pipe["lag"]) <= 2
    assert res["ratio"] == pytest.approx(pipe["samples_per_s"] / max(res["setups"]["sync (split)"]["samples_per_s"],
                                                                     res["setups"]["sync colocated"]["samples_per_s"]))
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_cli_refuses_bad_input(tmp_path, capsys):
    cfg = str(REPO / "configs" / "cpu-demo.yaml")
    assert main(["plan", cfg, "--gpus", "4", "--profile", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["plan", cfg, "--gpus", "4", "--profile", str(bad)]) == 2
    prof = small_profile().save(tmp_path / "p.json")
    assert main(["plan", cfg, "--gpus", "1", "--profile", str(prof)]) == 2  # no device left for a trainer
    assert main(["plan", cfg, "--gpus", "4", "--profile", str(prof), "--lengths", "zipf:2"]) == 2
    assert "inflight plan:" in capsys.readouterr().err
    out = str(tmp_path / "never.json")
    assert main(["profile", cfg, "trainer.backend=fsdp2", "--out", out]) == 2  # refused before measuring anything
    assert main(["profile", cfg, "--out", out, "--no-trainer", "--server", "http://127.0.0.1:9"]) == 2  # no tokens/s
    assert not Path(out).exists()


@pytest.mark.slow
def test_profile_cli_measures_a_tiny_model(tmp_path, capsys):
    from inflight.config.tasks import TaskConfig
    from inflight.modelkit.build import make_model

    model = make_model(TaskConfig(), tmp_path / "tiny", size="tiny")
    out = tmp_path / "prof.json"
    code = main(["profile", str(REPO / "configs" / "cpu-demo.yaml"), f"model.path={model}", "actor.groups_per_step=2",
                 "server.max_batch=32", "--out", str(out), "--batches", "1,16", "--contexts", "24"])
    assert code == 0
    p = Profile.load(out)
    assert p.engine.decode.batches == [1, 16] and p.engine.decode.contexts == [24]
    assert p.engine.max_model_len == 512  # sized as the config's server (server.max_model_len), not just the grid
    step1, step16 = p.engine.decode.step_s[0]
    assert 0 < step1 < 1.0 and 0 < step16 < 1.0
    assert p.engine.prefill_tokens_per_s > 0 and p.trainer.tokens_per_s > 0 and p.pause_s > 0
    assert 0.5 < p.engine.run_step_factor < 3.0  # timed under the config's traffic against plain steps (traffic.py)
    # the shape the trainer was timed on (defaults: 8-token prompts, 12-token completions, the config's groups of 8)
    t = p.trainer
    assert (t.prompt_tokens, t.completion_tokens, t.group_size) == (8, 12, 8)
    assert t.forward_tokens_per_s_at(1) == pytest.approx(t.tokens_per_s * (8 + 8 * 12) / (8 * 20))
    assert 0.0 <= t.length_slope <= 0.1  # timed again at 6-token completions: a longer row never costs less
    assert p.pause_s < p.push_s < 5.0  # a real push to a real server: more than the swap alone
    for reply in (p.server_reply_s(96), p.actor_reply_s(96), p.trainer_read_s(96)):  # timed on the real code
        assert 0 < reply < 0.5
    assert "measured by `inflight profile" in p.source
    assert 1.0 <= p.trainer_corun < 3.0 and 1.0 <= p.server_corun < 3.0  # measured beside each other (corun.py)
    # the actor's loop and the server's HTTP thread wake up to handle each group (counted on the real code), and a
    # thread that wakes beside as many busy processes as there are cores waits for one (corun.py)
    assert 1 <= p.actor_wakeups_per_group < 200 and 0 < p.server_wakeups_per_group < 200
    assert 0 < p.wakeup_wait_s < 0.05
    saved = json.loads(out.read_text())  # the push beside training, decoding and both (corun.py): what it adds
    assert all(0.0 <= saved[f"push_beside_{k}_s"] < 1.0 for k in ("train", "decode", "both"))
    if len(os.sched_getaffinity(0)) >= 2:  # the decoding the server's HTTP work costs (reply.py: 2 cores)
        assert "server_http_stall" in saved and 0.0 <= p.server_http_stall < 3.0
        assert 0.0 <= p.server_http_spin <= 1.5 * p.server_http_stall + 0.5  # the engine's CPU while it waits
        assert p.push_beside_both_s > 0  # beside two busy threads on 2 cores, the push's threads wait for a core


@pytest.mark.slow
def test_server_curve_over_http(tmp_path):
    """The step-time curve of a running OpenAI-compatible server (here `inflight serve`; vLLM and SGLang alike)."""
    from inflight.config.tasks import TaskConfig
    from inflight.engine.serve import ServerProcess
    from inflight.modelkit.build import make_model
    from inflight_plan.measure import measure_server

    model = make_model(TaskConfig(), tmp_path / "tiny", size="tiny")
    with ServerProcess(str(model), extra_args=["--threads", "1", "--max-model-len", "256"]) as server:
        eng = measure_server(server.url, [1, 8], [24], new_tokens=(4, 20))
    assert eng.decode.batches == [1, 8] and len(eng.decode.step_s[0]) == 2
    assert all(0 < v < 1.0 for v in eng.decode.step_s[0])
    assert eng.prefill_tokens_per_s > 0 and server.url in eng.name


def test_roofline_by_hand():
    from inflight_plan import roofline

    hw = roofline.Hardware("h", bandwidth=1e12, flops=1e15, mem_eff=0.5, flop_eff=0.5, train_mfu=0.25)
    m = roofline.ModelShape("m", params=1e9, layers=10, kv_heads=2, head_dim=64)
    assert m.kv_bytes_per_token == 2 * 10 * 2 * 64 * 2
    # weights 2e9 B + 8 x 100 x 5120 B of KV at 0.5e12 B/s, plus 8 x 2e9 FLOP at 0.5e15 FLOP/s
    want = (2e9 + 8 * 100 * 5120) / 0.5e12 + 8 * 2e9 / 0.5e15
    assert roofline.step_s(hw, m, 8, 100) == pytest.approx(want)
    assert roofline.step_s(hw, m, 8, 100, tp=2) == pytest.approx(want / 2)
    p = roofline.profile(hw, m, batches=[1, 8], contexts=[100], max_batch=8, source="ON PAPER: test", notes="",
                         push_s=1.0, pause_s=0.1)
    assert p.engine.decode.step_time(8, 100) == pytest.approx(want)
    assert p.trainer.tokens_per_s == pytest.approx(0.25e15 / 6e9)
    assert p.engine.prefill_tokens_per_s == pytest.approx(0.5e15 / 2e9)


def test_plan_cli_takes_lengths_from_a_run_folder(tmp_path, capsys):
    steps = [{"event": "train_step", "time": 10.0 + i, "samples_total": 64 * (i + 1), "samples": 64,
              "lag_hist": {"0": 5},
              "completion_len_mean": 30.0, "completion_len_min": 10, "completion_len_max": 50, "prompt_tokens": 40,
              "group_indices": list(range(8 * i, 8 * i + 8)), "trained_samples": 32, "train_s": 0.5}
             for i in range(3)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps) + "{cut")
    prof = small_profile().save(tmp_path / "p.json")
    assert main(["plan", str(REPO / "configs" / "cpu-demo.yaml"), "actor.groups_per_step=8", "--gpus", "3",
                 "--profile", str(prof), "--lengths-from", str(run), "--steps", "4"]) == 0
    assert "mean completion 30 tokens" in capsys.readouterr().out


def test_a_step_s_lengths_spread_from_its_min_to_its_max_with_its_mean():
    from inflight_plan.runs import spread

    assert spread(8, 30.0, 10, 50) == [10, 16, 21, 27, 33, 39, 44, 50]  # mean halfway: an even spread (k = 1)
    v = spread(128, 65.0, 27, 139)  # a long tail, as a scratchpad step has: most below the mean, some up to 139
    assert v == sorted(v) and (v[0], v[-1]) == (27, 139) and len(v) == 128
    assert sum(v) / 128 == pytest.approx(65.0, abs=0.5) and len(set(v)) > 50 and v[64] < 65
    assert spread(4, 3.0, 3, 3) == [3, 3, 3, 3] and spread(1, 7.0, 7, 7) == [7]


def test_trained_share_counts_forward_tokens_as_the_simulator_does():
    from inflight_plan.runs import trained_share

    # 2 groups of 4 per step, 10-token prompts (a step records them once per group: 20). Step 1: one group trained
    # (its completions 4 x 5 tokens; the other group's 4 x 20 untrained): the trainer ran 10 + 20 = 30 forward
    # tokens (prompt once) of 20 + 100 = 120.
    s1 = {"samples": 8, "trained_samples": 4, "prompt_tokens": 20, "completion_tokens": 100, "trainer_tokens": 30}
    # step 2: both trained, 8 x 10 completion tokens, 2 prompts: 100 forward tokens of 100
    s2 = {"samples": 8, "trained_samples": 8, "prompt_tokens": 20, "completion_tokens": 80, "trainer_tokens": 100}
    assert trained_share([s1, s2], groups_per_step=2) == pytest.approx((30 + 100) / (120 + 100))
    # by samples it would be 12 / 16 = 0.75: the long untrained group weighs more by tokens
    assert trained_share([{"samples": 8, "trained_samples": 2}], 2) == pytest.approx(0.25)  # old records: by samples


def test_an_older_profile_gets_its_trainer_shape_from_its_notes(tmp_path):
    data = json.loads(small_profile().model_dump_json())
    for k in ("prompt_tokens", "completion_tokens", "group_size"):
        data["trainer"].pop(k)
    data["notes"] = "server threads 1, trainer threads 1, trainer measured on 15-token prompts, 64-token completions"
    (tmp_path / "old.json").write_text(json.dumps(data))
    t = Profile.load(tmp_path / "old.json").trainer
    assert (t.prompt_tokens, t.completion_tokens, t.group_size) == (15, 64, 0)
    assert t.forward_share(8) == pytest.approx((15 + 8 * 64) / (8 * (15 + 64)))


def test_the_trainer_charge_grows_with_the_groups_length_as_measured():
    import dataclasses

    from inflight_plan.sim import simulate
    from tests.plan.test_sim import BASE

    t = TrainerProfile(tokens_per_s=1000.0, prompt_tokens=0, completion_tokens=64, group_size=8, length_slope=0.005)
    assert t.length_factor(64) == 1.0 and t.length_factor(32) == pytest.approx(0.84)
    assert t.length_factor(128) == pytest.approx(1.32) and t.length_factor(-1000) == 0.25  # never below a quarter
    assert TrainerProfile(tokens_per_s=1.0, length_slope=0.005).length_factor(5) == 1.0  # no shape: flat
    # a trainer-bound sync loop on 10-token completions: the trainer's seconds scale by 1 + 0.005 (10 - 64) = 0.73
    flat = small_profile().model_copy(update={"trainer": t.model_copy(update={"length_slope": 0.0}),
                                              "overhead_s": 0.0})
    sloped = flat.model_copy(update={"trainer": t})
    cfg = dataclasses.replace(BASE, mode="sync", num_grad_steps=1)
    a, b = simulate(flat, cfg), simulate(sloped, cfg)
    trainer_s = lambda r: r.trainer_busy * r.seconds_per_step - flat.trainer.step_overhead_s  # noqa: E731
    assert trainer_s(b) == pytest.approx(0.73 * trainer_s(a), rel=1e-3)
    with pytest.raises(ValidationError):
        TrainerProfile(tokens_per_s=1.0, length_slope=0.5)
