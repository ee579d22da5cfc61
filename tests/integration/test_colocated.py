"""The colocated baseline (`kvferry up --colocated`): decode workers run both phases behind the same
router, with no prefill workers and no pool. Same tokens as transformers; aborts free everything."""

from __future__ import annotations

import grpc
import pytest
from cluster_helpers import assert_released, greedy, random_prompt

from kvferry.router.client import Client

# a shared cluster of conftest's (this module is its only user)
pytestmark = [pytest.mark.slow, pytest.mark.shared_cluster(colocated=True)]

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def colocated(cluster):
    return cluster


def test_greedy_matches_transformers(colocated, tiny_model_dir, hf_greedy):
    prompts = [random_prompt(300 + s, n) for s, n in enumerate((5, 16, 17, 31, 32, 48, 70, 9))]
    prompts[7] = [*prompts[5][:32], 5, 6, 7]  # a local prefix-cache hit in the one worker
    with Client(colocated.router_addr) as client:
        info = client.model_info(timeout=10)
        assert (info.num_prefill_workers, info.num_decode_workers, info.num_pool_nodes) == (0, 1, 0)
        for ids, ref in zip(prompts, hf_greedy(tiny_model_dir, prompts, NEW_TOKENS), strict=True):
            got = client.generate(greedy(ids, NEW_TOKENS), timeout=60)
            assert got.token_ids == ref, f"colocated != transformers for a {len(ids)}-token prompt"
            timings = got.finished.timings
            assert 0 < timings.ttft_ms <= timings.e2e_ms


def test_abort_and_stop_free_the_worker(colocated, members):
    with Client(colocated.router_addr) as client:
        stream = client.stream(
            greedy(random_prompt(40, 40), max_tokens=900, request_id="co-abort"), timeout=120
        )
        next(stream)
        client.abort("co-abort")
        assert list(stream)[-1].finished.finish_reason == "abort"
        with pytest.raises(grpc.RpcError) as err:  # 900 tokens take ~0.5 s: expires mid-generation
            client.generate(greedy(random_prompt(41, 40), max_tokens=900), timeout=0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert_released(members)  # the worker holds no request and frees every block
        assert (
            client.generate(greedy(random_prompt(42, 20), max_tokens=4), timeout=60).finished.output_tokens
            == 4
        )


def test_loadtest_sweep_end_to_end(colocated, tmp_path):
    """`kvferry loadtest sweep` with --compare: locust runs per rate and target, records, CSV, JSON, PNGs."""
    import csv
    import json

    from kvferry.cli import main
    from kvferry.loadtest.metrics import read_records

    out = tmp_path / "sweep"
    argv = ["loadtest", "sweep", "--target", colocated.router_addr, "--compare", colocated.router_addr]
    argv += ["--labels", "first,second", "--rates", "2,6", "--duration", "3", "--input-len", "40"]
    argv += ["--output-len", "8", "--prefix-share", "0.5", "--slo-ttft", "2", "--slo-tpot", "0.5"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "summary.json").read_text())
    assert set(report["targets"]) == {"first", "second"}
    for label, result in report["targets"].items():
        assert [r["rate"] for r in result["rates"]] == [2.0, 6.0]
        for rate in result["rates"]:
            records = read_records(out / label / f"rate-{rate['rate']:g}.jsonl")
            assert rate["sent"] == len(records) > 0
            assert all(r.ok and r.output_tokens == 8 for r in records), "every request should succeed"
            assert rate["completed"] == rate["sent"] and rate["ttft_ms"]["p50"] > 0
        attainments = [r["attainment"] for r in result["rates"]]
        if min(attainments) >= 0.9:  # generous SLOs on a tiny model: usually met at both rates
            assert result["goodput"] == 6.0
    with (out / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {"ttft_ms_p99", "tpot_ms_p90", "goodput"} <= set(rows[0])
    for name in ("attainment.png", "latency.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_logprobs_prompt_logprobs_and_penalties_colocated(
    colocated, tiny_model_dir, hf_greedy, hf_log_softmax
):
    """One worker does both phases: it scores the prompt and the outputs itself (as transformers does),
    and the penalties count its own outputs."""
    from kvferry.router.client import build_request

    ids = random_prompt(350, 33)
    request = build_request(
        prompt_token_ids=ids, max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    with Client(colocated.router_addr) as client:
        for _ in range(2):  # the second time its blocks are cached: still every prompt token is scored
            messages = list(client.stream(request, timeout=60))
            tokens = [t for m in messages for t in m.token_ids]
            ref = hf_log_softmax(tiny_model_dir, ids + tokens)
            prompt_lps = messages[0].prompt_logprobs
            assert [lp.token_id for lp in prompt_lps] == ids[1:]
            for j, lp in enumerate(prompt_lps, 1):
                assert lp.logprob == pytest.approx(ref[j - 1, ids[j]].item(), abs=2e-4)
            lps = [lp for m in messages for lp in m.logprobs]
            assert [lp.token_id for lp in lps] == tokens
            for i, lp in enumerate(lps):
                assert lp.logprob == pytest.approx(ref[len(ids) - 1 + i, tokens[i]].item(), abs=2e-4)
        penalized = build_request(
            prompt_token_ids=ids, max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.8
        )
        (want,) = hf_greedy(tiny_model_dir, [ids], 10, repetition_penalty=1.8)
        assert client.generate(penalized, timeout=60).token_ids == want


def test_n_sequences_share_the_prompt_in_the_workers_prefix_cache(colocated):
    """Colocated n: the leader computes the prompt; its siblings start once its first token is out and
    find the prompt's full blocks in the same worker's prefix cache."""
    from kvferry.router.client import build_request

    ids = random_prompt(360, 40)  # 2 full blocks and a tail
    request = build_request(prompt_token_ids=ids, max_tokens=4, temperature=1.0, ignore_eos=True, n=3)
    with Client(colocated.router_addr) as client:
        messages = list(client.stream(request, timeout=60))
    finished = {m.index: m.finished for m in messages if m.HasField("finished")}
    assert sorted(finished) == [0, 1, 2]
    assert finished[0].cached_tokens == 0
    assert finished[1].cached_tokens == finished[2].cached_tokens == 32
    assert all(f.output_tokens == 4 for f in finished.values())
