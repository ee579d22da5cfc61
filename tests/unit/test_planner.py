"""The planner (deploy.planner): needs from the cost model, bounded one-step decisions with a cool-down,
what the routers publish (router.traffic), `kvferry plan --trace`, and the cluster settings."""

from __future__ import annotations

import json

import pytest

from kvferry.deploy import planner
from kvferry.deploy.config import ClusterConfigError, cluster_config_from_dict, cluster_config_to_dict
from kvferry.deploy.planner import (
    AutoscaleSettings,
    Bounds,
    Needs,
    Planner,
    PlanTargets,
    RoleLoad,
    Traffic,
    desired,
    needs,
    next_step,
)
from kvferry.engine.cost_model import StepCost
from kvferry.router.traffic import TrafficWindow

COST = StepCost(fixed_ms=5.0, per_token_ms=0.1, per_kpair_ms=0.0)  # a 1000-token prefill: 2 chunks, 110 ms
TARGETS = PlanTargets(ttft_ms=1000.0, tpot_ms=100.0, utilization=0.8)


def beat(**kw) -> dict:
    return {"step_cost": COST.to_list(), "token_budget": 512, "free_blocks": 90, "total_blocks": 100} | kw


def test_prefill_need_is_arrivals_times_the_priced_prefill_over_utilization():
    traffic = Traffic(arrival_rps=10.0, prompt_tokens=1000, uncached_tokens=1000, output_tokens=32)
    load = RoleLoad.from_beats([beat(), beat()])
    prefill_ms = COST.prompt_ms(1000, 512)
    assert planner.prefill_need(traffic, load, TARGETS) == pytest.approx(10 * prefill_ms / 1e3 / 0.8)
    # cache hits: only the computed tokens are priced
    hit = Traffic(arrival_rps=10.0, prompt_tokens=1000, uncached_tokens=100, output_tokens=32)
    assert planner.prefill_need(hit, load, TARGETS) < planner.prefill_need(traffic, load, TARGETS) / 5
    assert planner.prefill_need(traffic, RoleLoad(), TARGETS) is None  # nothing fitted yet


def test_decode_capacity_is_the_largest_batch_whose_step_fits_the_tpot_target():
    cost = StepCost(fixed_ms=10.0, per_token_ms=1.0, per_kpair_ms=0.0)
    batch, tokens_per_s = planner.decode_capacity(cost, 100, TARGETS, pace_ms=0.0, seats=256)
    assert batch == 70  # 10 + 70 = 80 ms = 0.8 x 100 ms
    assert tokens_per_s == pytest.approx(70 / 0.080)
    assert planner.decode_capacity(cost, 100, TARGETS, 0.0, seats=16)[0] == 16  # the seats bound it
    slow = StepCost(fixed_ms=500.0, per_token_ms=1.0, per_kpair_ms=0.0)
    assert planner.decode_capacity(slow, 100, TARGETS, 0.0, 256)[0] == 1  # at least one stream
    traffic = Traffic(arrival_rps=2.0, prompt_tokens=128, uncached_tokens=128, output_tokens=512)
    load = RoleLoad(cost=cost, max_num_seqs=256)
    assert planner.decode_need(traffic, load, TARGETS) == pytest.approx(2 * 512 / (70 / 0.080))


def test_measured_misses_raise_the_need_above_the_model():
    traffic = Traffic(
        arrival_rps=0.1, prompt_tokens=100, uncached_tokens=100, output_tokens=10, ttft_p90_ms=3000
    )
    queued = RoleLoad.from_beats([beat(waiting=3)])
    need = needs(traffic, queued, RoleLoad.from_beats([beat()]), (2, 1), TARGETS)
    assert need.prefill == 3 and any("TTFT p90" in why for why in need.why)
    idle = needs(traffic, RoleLoad.from_beats([beat()]), RoleLoad.from_beats([beat()]), (2, 1), TARGETS)
    assert idle.prefill < 1  # a slow TTFT with nothing queued is not prefill's to fix
    slow = Traffic(arrival_rps=0.1, prompt_tokens=100, uncached_tokens=100, output_tokens=10, tpot_p90_ms=150)
    assert needs(slow, queued, RoleLoad.from_beats([beat()]), (1, 2), TARGETS).decode == 3
    full = RoleLoad.from_beats([beat(free_blocks=5)])  # 95% of the KV in use
    assert needs(Traffic(), queued, full, (1, 2), TARGETS).decode == pytest.approx(2 * 0.95 / 0.8)
    unfitted = needs(Traffic(arrival_rps=5), RoleLoad(), RoleLoad(), (2, 3), TARGETS)
    assert (unfitted.prefill, unfitted.decode) == (2, 3)  # nothing fitted: counts kept


def test_desired_counts_are_bounded_with_a_down_margin_and_split_under_max_groups():
    bounds = Bounds(prefill=(1, 3), decode=(1, 3))
    assert desired(Needs(2.4, 0.5), (1, 1), bounds, 1.25) == (3, 1)
    assert desired(Needs(9.0, 9.0), (1, 1), bounds, 1.25) == (3, 3)  # the maxima
    assert desired(Needs(0.0, 0.0), (3, 3), bounds, 1.25) == (1, 1)  # the minima
    # down only when 1.25 x the need fits in one fewer: 1.7 x 1.25 = 2.1 needs 3 -> kept
    assert desired(Needs(1.7, 1.0), (3, 1), bounds, 1.25) == (3, 1)
    assert desired(Needs(1.5, 1.0), (3, 1), bounds, 1.25) == (2, 1)
    capped = Bounds(prefill=(1, 3), decode=(1, 3), max_groups=3)
    assert desired(Needs(3.0, 1.0), (1, 2), capped, 1.25) == (2, 1)
    assert desired(Needs(0.5, 4.0), (2, 1), capped, 1.25) == (1, 2)
    with pytest.raises(ValueError, match="min <= max"):
        Bounds(prefill=(2, 1)).validate()
    with pytest.raises(ValueError, match="below the minimum"):
        Bounds(prefill=(2, 3), decode=(2, 3), max_groups=3).validate()


def test_one_group_moves_per_step():
    assert next_step((1, 1), (3, 1)) == (2, 1)
    assert next_step((2, 1), (1, 2)) == (1, 2)  # a move: one group from prefill to decode
    assert next_step((1, 3), (2, 1)) == (2, 2)
    assert next_step((1, 1), (2, 3)) == (1, 2)  # the role further below first
    assert next_step((3, 3), (1, 2)) == (2, 3)
    assert next_step((2, 2), (2, 2)) == (2, 2)


class FakeLauncher:
    def __init__(self, p: int, d: int, fail: bool = False):
        self.groups, self.fail, self.calls = [p, d], fail, []

    def counts(self):
        return tuple(self.groups)

    def scale(self, p: int, d: int):
        self.calls.append((p, d))
        if self.fail:
            raise RuntimeError("no room")
        self.groups = [p, d]


def records(rate: float, prompt: int = 1000, output: int = 32, **router) -> dict:
    traffic = {
        "arrival_rps": rate,
        "prompt_tokens": prompt,
        "uncached_tokens": prompt,
        "output_tokens": output,
    }
    traffic |= {"finished": int(rate * 20)} | router
    return {"router": {"r0": traffic}, "prefill": {"p0": beat()}, "decode": {"d0": beat()}}


def test_the_planner_scales_up_one_step_a_cool_down_and_back_down():
    settings = AutoscaleSettings(enabled=True, prefill=(1, 3), decode=(1, 2), cooldown_s=30)
    launcher, said = FakeLauncher(1, 1), []
    plan = Planner(settings, TARGETS, launcher.counts, launcher.scale, said.append)
    busy = records(rate=20.0)  # 20 x 110 ms / 0.8 = 2.75 prefill groups
    assert plan.tick(busy, now=0.0).after == (2, 1)
    assert plan.tick(busy, now=10.0) is None  # the cool-down
    plan.last_change = 0.0
    assert plan.tick(busy, now=31.0).after == (3, 1)
    assert plan.tick(busy, now=100.0) is None  # at its need
    idle = records(rate=0.0)
    plan.last_change = 0.0
    assert plan.tick(idle, now=200.0).after == (2, 1)
    plan.last_change = 0.0
    assert plan.tick(idle, now=300.0).after == (1, 1)
    plan.last_change = 0.0
    assert plan.tick(idle, now=400.0) is None  # the minimum
    assert launcher.calls == [(2, 1), (3, 1), (2, 1), (1, 1)]
    assert plan.totals == {"prefill:up": 2, "prefill:down": 2}
    assert any("prefill 1 -> 2" in line and "need prefill 2.7" in line for line in said)
    record = plan.record()
    assert record["decisions"] == {"prefill:up": 2, "prefill:down": 2} and record["groups"] == [1, 1]
    assert json.loads(json.dumps(record))["last"][-1]["after"] == [1, 1]


def test_the_planner_never_scales_a_role_down_while_its_slo_misses_and_counts_failures():
    settings = AutoscaleSettings(enabled=True, prefill=(1, 3), decode=(1, 3), cooldown_s=0)
    launcher = FakeLauncher(2, 2)
    plan = Planner(settings, TARGETS, launcher.counts, launcher.scale, lambda _: None)
    missing = records(rate=0.0, ttft_p90_ms=5000.0, tpot_p90_ms=500.0)
    decision = plan.tick(missing, now=0.0)
    assert decision.after == (2, 3)  # TPOT misses: decode up; TTFT misses: prefill not down
    failing = FakeLauncher(1, 1, fail=True)
    plan = Planner(settings, TARGETS, failing.counts, failing.scale, lambda _: None)
    decision = plan.tick(records(rate=20.0), now=0.0)
    assert not decision.ok and "no room" in decision.error and plan.failures == 1
    assert plan.totals == {} and failing.groups == [1, 1]


def test_a_shift_moves_groups_between_roles_under_max_groups():
    settings = AutoscaleSettings(enabled=True, prefill=(1, 2), decode=(1, 2), max_groups=3, cooldown_s=0)
    launcher = FakeLauncher(2, 1)
    plan = Planner(settings, TARGETS, launcher.counts, launcher.scale, lambda _: None)
    slow_decode = {"step_cost": [30.0, 1.0, 0.0], "token_budget": 512, "max_num_seqs": 256}
    decode_heavy = records(rate=2.0, prompt=128, output=512)  # 1.6 decode groups
    decode_heavy["decode"] = {"d0": slow_decode}
    assert plan.tick(decode_heavy, now=0.0).after == (1, 2)


def test_traffic_window_rates_means_and_percentiles():
    now = [100.0]
    window = TrafficWindow(window_s=10.0, clock=lambda: now[0])
    for i in range(10):
        window.arrived(100 + i)
        window.finished(100, 40, 32, ttft_ms=float(i * 10), tpot_ms=50.0)
    window.rejected()
    now[0] = 110.0
    summary = window.summary()
    assert summary["arrival_rps"] == pytest.approx(1.0) and summary["refused_rps"] == pytest.approx(0.1)
    assert summary["prompt_tokens"] == pytest.approx(104.5) and summary["uncached_tokens"] == 60
    assert summary["ttft_p90_ms"] == 90.0 and summary["tpot_p50_ms"] == 50.0 and summary["finished"] == 10
    now[0] = 121.0  # all of it older than the window
    assert window.summary()["arrival_rps"] == 0 and window.summary()["ttft_p90_ms"] is None
    merged = Traffic.merge(
        [{"arrival_rps": 2.0, "prompt_tokens": 100}, {"arrival_rps": 6.0, "prompt_tokens": 300}]
    )
    assert merged.arrival_rps == 8.0 and merged.prompt_tokens == 250.0


def trace_lines(rows) -> list[str]:
    return [json.dumps({"arrival_s": t, "prompt_tokens": p, "output_tokens": o}) for t, p, o in rows]


def test_plan_trace_follows_a_shifting_workload():
    rows = [(i * 0.1, 2000, 32) for i in range(600)] + [(60 + i * 0.5, 128, 512) for i in range(120)]
    trace = planner.read_trace(trace_lines(rows))
    prefill = RoleLoad(cost=COST, budget=512)
    decode = RoleLoad(cost=StepCost(10.0, 1.0, 0.0))
    plan = planner.plan_trace(trace, prefill, decode, TARGETS, window_s=60.0)
    first, second = plan["windows"]
    assert first["prefill"] > second["prefill"] and second["decode"] > first["decode"]
    assert plan["fixed"] == {"prefill": first["prefill"], "decode": second["decode"]}
    split = planner.plan_trace(trace, prefill, decode, TARGETS, window_s=60.0, max_groups=4)["fixed"]
    assert split["prefill"] + split["decode"] == 4 and split["prefill"] >= 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "not a JSON object"),
        ('{"prompt_tokens": 1, "output_tokens": 2}', "no arrival_s"),
        ('{"arrival_s": 0, "prompt_tokens": -1, "output_tokens": 2}', "prompt_tokens must be"),
        ('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2, "cached_tokens": 9}', "cached_tokens"),
        ("{", "line 1"),
    ],
)
def test_read_trace_names_the_bad_line(line, message):
    with pytest.raises(ValueError, match=message):
        planner.read_trace([line])


def test_autoscale_settings_load_validate_and_round_trip():
    cfg = cluster_config_from_dict({"autoscale": {"enabled": True, "prefill": [1, 3], "decode": "2:4"}})
    assert cfg.autoscale.prefill == (1, 3) and cfg.autoscale.decode == (2, 4)
    assert cluster_config_from_dict(cluster_config_to_dict(cfg)) == cfg
    for bad in ({"prefill": [3, 1]}, {"utilization": 0}, {"cooldown_s": -1}, {"prefill": "x"}):
        with pytest.raises(ClusterConfigError):
            cluster_config_from_dict({"autoscale": bad})
    with pytest.raises(ClusterConfigError, match="colocated"):
        cluster_config_from_dict({"colocated": True, "autoscale": {"enabled": True}})
    flags = cluster_config_from_dict({}).with_overrides(
        autoscale=True, autoscale_prefill="1:2", autoscale_max_groups=3, autoscale_cooldown_s=5.0
    )
    assert flags.autoscale.enabled and flags.autoscale.prefill == (1, 2) and flags.autoscale.max_groups == 3
    with pytest.raises(ClusterConfigError, match="MIN:MAX"):
        cluster_config_from_dict({}).with_overrides(autoscale_decode="3")


def test_kvferry_plan_recommends_a_split_for_a_trace_file(tmp_path, capsys):
    from kvferry.cli import main

    rows = [(i * 0.1, 2000, 32) for i in range(600)] + [(60 + i * 0.25, 128, 512) for i in range(240)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(trace_lines(rows)) + "\n")
    costs = ["--prefill-cost", "5,0.1,0", "--decode-cost", "10,1,0"]
    assert main(["plan", "--trace", str(trace), *costs, "--max-groups", "4"]) == 0
    out = capsys.readouterr()
    plan = json.loads(out.out.strip().splitlines()[-1])
    assert len(plan["windows"]) == 2 and plan["costs"]["source"] == "given"
    assert plan["fixed"]["prefill"] + plan["fixed"]["decode"] == 4
    assert "recommended: prefill" in out.err
    trace.write_text('{"arrival_s": 0}\n')
    assert main(["plan", "--trace", str(trace), *costs]) == 2
    assert "trace line 1: no prompt_tokens" in capsys.readouterr().err
    assert main(["plan", "--trace", str(tmp_path / "missing.jsonl"), *costs]) == 2
    # the flags' names from before they were derived from the configs still work
    trace.write_text("\n".join(trace_lines(rows)) + "\n")
    old = ["--slo-ttft-ms", "700", "--slo-tpot-ms", "80", "--token-budget", "256", "--decode-pace-ms", "5"]
    assert main(["plan", "--trace", str(trace), *costs, *old]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["slo"]["ttft_ms"] == 700


def test_a_role_that_missed_keeps_the_group_it_took_until_the_lesson_fades():
    settings = AutoscaleSettings(
        enabled=True, prefill=(1, 3), decode=(1, 3), cooldown_s=0, scale_half_life_s=60
    )
    launcher = FakeLauncher(1, 1)
    plan = Planner(settings, TARGETS, launcher.counts, launcher.scale, lambda _: None)
    light = records(rate=1.0, prompt=100, output=100)  # the model: 0.16 decode groups
    light["decode"] = {"d0": {"step_cost": [30.0, 1.0, 0.0], "token_budget": 512, "max_num_seqs": 256}}
    assert plan.tick(
        light | {"router": {"r0": light["router"]["r0"] | {"tpot_p90_ms": 150.0}}}, 0.0
    ).after == (1, 2)
    model_need = plan.last_need.model[1]
    assert model_need < 0.5 and plan.model_scale[1] == pytest.approx(2 / model_need)
    # the misses stop: the learned scale keeps the model's figure at two groups (no flapping back)
    assert plan.tick(light, 10.0) is None and plan.last_need.decode > 1.6
    # it fades: four half-lives later the excess is 1/16 and the group goes
    assert plan.tick(light, 250.0).after == (1, 1)
    assert plan.model_scale[1] < 1 + (2 / model_need) / 15


def test_misses_from_before_a_change_do_not_ratchet_the_role_up():
    settings = AutoscaleSettings(enabled=True, prefill=(1, 3), decode=(1, 4), cooldown_s=0)
    launcher = FakeLauncher(1, 1)
    plan = Planner(settings, TARGETS, launcher.counts, launcher.scale, lambda _: None)
    missing = records(rate=1.0, prompt=100, output=100)
    missing["router"]["r0"] |= {"tpot_p90_ms": 150.0, "window_s": 20.0}
    assert plan.tick(missing, 0.0).after == (1, 2)
    learned = plan.model_scale[1]
    # the routers' window still holds the misses of the single group: not a reason for a third
    assert plan.tick(missing, 10.0) is None and plan.model_scale[1] <= learned
    assert plan.tick(missing, 25.0).after == (1, 3)  # a window measured on two groups that still miss


def test_the_planner_sums_the_traffic_of_every_router(redis_url):
    """Three routers, each with its share of the arrivals, publish their windows in the registry: the
    planner plans for the sum of them (20 req/s of 1050 tokens on average: 3 prefill groups), not for any
    one (at most 8 req/s: 1.2 groups)."""
    from kvferry.kvpool.metadata import MetadataStore

    meta = MetadataStore(redis_url, "planner-sum")
    now = [100.0]
    shares = {"r0": (50, 500, 1), "r1": (80, 1000, 0), "r2": (70, 1500, 2)}  # arrivals, prompt, misses
    for name, (arrivals, prompt, misses) in shares.items():
        window = TrafficWindow(window_s=10.0, clock=lambda: now[0] - 10.0)
        for _ in range(arrivals):
            window.arrived(prompt)
            window.finished(prompt, 0, 32, ttft_ms=100.0, tpot_ms=20.0)
        for _ in range(misses):
            window.predicted_miss("ttft")
        window.clock = lambda: now[0]
        assert meta.register(planner.ROUTER_ROLE, name, window.summary(), ttl_s=30)
    meta.register("prefill", "p0", beat(), ttl_s=30)
    meta.register("decode", "d0", beat(), ttl_s=30)

    launcher = FakeLauncher(1, 1)
    settings = AutoscaleSettings(enabled=True, prefill=(1, 3), decode=(1, 2), cooldown_s=30)
    plan = Planner(settings, TARGETS, launcher.counts, launcher.scale, lambda line: None)
    read = planner.Autoscaler(meta, plan, interval_s=1.0).read()
    assert sorted(read[planner.ROUTER_ROLE]) == ["r0", "r1", "r2"]  # every router's record, not one
    traffic = Traffic.merge(list(read[planner.ROUTER_ROLE].values()))
    assert traffic.arrival_rps == pytest.approx(20.0) and traffic.finished == 200
    assert traffic.miss_ttft_rps == pytest.approx(0.3)
    # means weighted by each router's share: (5 x 500 + 8 x 1000 + 7 x 1500) / 20
    assert traffic.prompt_tokens == pytest.approx(1050.0) and traffic.uncached_tokens == pytest.approx(1050.0)
    assert plan.tick(read, now=0.0).after == (2, 1)
    # 20 req/s x (3 chunks x 5 ms + 1050 x 0.1 ms) / 0.8: the sum's need
    assert plan.last_need.model[0] == pytest.approx(20 * 0.120 / 0.8)
