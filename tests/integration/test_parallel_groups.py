"""Tensor-parallel prefill groups x expert-parallel decode groups: greedy parity with transformers.

Every combination of prefill TP in {1, 2} and decode EP in {1, 2} is a real cluster (rank processes,
gloo groups, the pool, Redis, the router), plus one cluster mixing groups of different degrees. The TP=2 x
EP=2 cluster of the parity test is then drained by the next test (conftest's cluster_for: one start).
"""

from __future__ import annotations

import contextlib
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_helpers import ENGINE, Members, greedy, make_cluster_config, metric, random_prompt, wait_for

from kvferry.deploy.config import WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import Client

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
CORNERS = [(1, 2), (2, 1), (2, 2)]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """8 prompts of mixed lengths; the last one shares a 3-block (48-token) prefix with the first."""
    out = [random_prompt(100 + s, n) for s, n in enumerate((53, 16, 17, 31, 32, 70, 9, 0))]
    out[7] = out[0][:48] + random_prompt(200, 11)
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts, hf_greedy) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, prompts, NEW_TOKENS)


CONTROLS = {
    "max_tokens": 12,
    "temperature": 0.0,
    "min_tokens": 12,
    "repetition_penalty": 1.3,
    "logprobs": 2,
    "prompt_logprobs": 1,
}
REGEX = "[a-z ]+"


@pytest.fixture(scope="module")
def controls_reference(tiny_engine, prompts):
    """The offline engine's answer (float32, one process) to a request under the sampling controls."""
    from kvferry.engine.request import SamplingParams

    params = SamplingParams(**CONTROLS, structured=("regex", REGEX))
    (done,) = tiny_engine.generate([{"prompt_token_ids": prompts[0], "params": params}])
    return done


def check_controls(addr: str, prompts, ref) -> None:
    """logprobs, prompt logprobs, a repetition penalty, min_tokens and a structured output through the
    cluster's groups, for n = 2 sequences (greedy: both are the reference)."""
    request = greedy(prompts[0], CONTROLS["max_tokens"])
    request.sampling.ignore_eos = False
    for name, value in CONTROLS.items():
        setattr(request.sampling, name, value)
    request.sampling.structured.regex = REGEX
    request.sampling.n = 2
    with Client(addr) as client:
        messages = list(client.stream(request, timeout=120))
    for index in (0, 1):
        mine = [m for m in messages if m.index == index]
        assert [t for m in mine for t in m.token_ids] == ref.output_token_ids
        got = [lp.logprob for m in mine for lp in m.logprobs]
        assert got == pytest.approx([lp.logprob for lp in ref.logprobs], abs=2e-4)
        prompt_lps = [lp.logprob for lp in mine[0].prompt_logprobs]
        assert prompt_lps == pytest.approx([lp.logprob for lp in ref.prompt_logprobs], abs=2e-4)


def group(replicas: int = 1, **degree) -> WorkerGroupSettings:
    return WorkerGroupSettings(replicas=replicas, engine={**ENGINE, **degree})


def corner(tp: int, ep: int) -> dict:
    """The settings of the cluster with one TP=`tp` prefill group and one EP=`ep` decode group."""
    return {"prefill": group(tensor_parallel_size=tp), "decode": group(expert_parallel_size=ep)}


def start(redis_server, tiny_model_dir, tmp_path_factory, name, prefill, decode) -> LocalCluster:
    cfg = make_cluster_config(
        tiny_model_dir, redis_server.url, f"test-parallel-{name}", prefill=prefill, decode=decode
    )
    return LocalCluster(cfg, log_dir=tmp_path_factory.mktemp(f"logs-{name}"), quiet=True)


def run_all(addr: str, prompts) -> list[list[int]]:
    with Client(addr) as client:
        # the shared-prefix pair goes one after the other, so the second finds the first's blocks
        first = client.generate(greedy(prompts[0], NEW_TOKENS), timeout=120).token_ids
        with ThreadPoolExecutor(4) as pool:
            rest = list(
                pool.map(
                    lambda ids: client.generate(greedy(ids, NEW_TOKENS), timeout=120).token_ids, prompts[1:]
                )
            )
    return [first, *rest]


@pytest.mark.parametrize(
    ("tp", "ep"),
    [pytest.param(tp, ep, marks=pytest.mark.shared_cluster(**corner(tp, ep))) for tp, ep in CORNERS],
)
def test_greedy_parity(cluster_for, prompts, reference, controls_reference, tp, ep):
    """(TP 1, EP 1) is test_cluster.py's cluster; these are the other three corners of the matrix. The
    sampling controls and outputs give the offline engine's answer in each too."""
    cluster = cluster_for(**corner(tp, ep))
    got = run_all(cluster.router_addr, prompts)
    for i, (tokens, ref) in enumerate(zip(got, reference, strict=True)):
        assert tokens == ref, f"prompt {i} (len {len(prompts[i])}) differs at TP={tp} EP={ep}"
    check_controls(cluster.router_addr, prompts, controls_reference)
    members = Members(cluster)
    try:
        prefill = members.stats("prefill")
        assert [(s.tensor_parallel_size, s.rank) for s in prefill.values()] == [(tp, 0)]
        assert sum(s.local_hit_tokens + s.pool_hit_tokens for s in prefill.values()) >= 48  # the pair
        decode = members.stats("decode")
        assert len(decode) == ep  # an EP group registers every rank
        if ep > 1:
            # each rank decoded some of the requests, and all report the group's expert load
            wait_for(lambda: all(s.requests > 0 for s in members.stats("decode").values()), 5, "both ranks")
            for s in decode.values():
                load = s.expert_load
                assert len(load.layers) == 2 and all(len(layer.tokens) == 4 for layer in load.layers)
                assert len(load.rank_moe_ms) == 2 and 0 < load.balance <= 1
                assert all(t > 0 for t in load.rank_tokens)
                assert sum(load.rank_tokens) == sum(sum(layer.tokens) for layer in load.layers)
    finally:
        members.close()


@contextlib.contextmanager
def exact_tp_prefill_cluster(request, checkpoint, decode, redis_server, tmp_path_factory, prompts, hf_greedy):
    """A cluster of `checkpoint` (a fixture's name) with one TP=2 prefill group and the `decode` group:
    yields (cluster, members) once every prompt's tokens equal transformers' and the prefill group has
    hit the shared prefix."""
    model_dir = request.getfixturevalue(checkpoint)
    reference = hf_greedy(model_dir, prompts, NEW_TOKENS)
    name = checkpoint.removesuffix("_dir")
    with start(
        redis_server, model_dir, tmp_path_factory, name, group(tensor_parallel_size=2), decode
    ) as cluster:
        got = run_all(cluster.router_addr, prompts)
        for i, (tokens, ref) in enumerate(zip(got, reference, strict=True)):
            assert tokens == ref, f"prompt {i} (len {len(prompts[i])}) differs on {checkpoint}"
        members = Members(cluster)
        try:
            prefill = members.stats("prefill")
            assert [(s.tensor_parallel_size, s.rank) for s in prefill.values()] == [(2, 0)]
            assert sum(s.local_hit_tokens + s.pool_hit_tokens for s in prefill.values()) >= 48
            yield cluster, members
        finally:
            members.close()


@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_a_dense_model_through_tp_prefill_and_the_pool(
    request, redis_server, checkpoint, tmp_path_factory, prompts, hf_greedy
):
    """A dense Llama 3 (no q/k norms, Llama 3.1's RoPE scaling) and a dense Qwen3: a TP=2 prefill group
    hands its KV to two data-parallel decode workers through the pool, exact against transformers; the
    shared-prefix prompt hits. (An expert-parallel decode group of a dense model is refused at launch:
    it has no experts to split.)"""
    with exact_tp_prefill_cluster(
        request, checkpoint, group(replicas=2), redis_server, tmp_path_factory, prompts, hf_greedy
    ) as (_, members):
        assert len(members.stats("decode")) == 2


@pytest.mark.parametrize("checkpoint", ["tiny_deepseek_dir", "tiny_deepseek_nolora_dir"])
def test_deepseek_v3_through_tp_prefill_the_pool_and_ep_decode(
    request, redis_server, checkpoint, tmp_path_factory, prompts, hf_greedy
):
    """A DeepSeek-V3 (latent attention, shared experts, grouped routing; the first with a q LoRA, 4
    expert groups and an MTP layer, the second without a q LoRA): a TP=2 prefill group (heads split, the
    latent replicated: rank 0 writes it) hands latent blocks, the MTP layer's rows among them, through
    the pool to an EP=2 decode group (routed experts split, shared experts on both ranks) drafting with
    the MTP layer where there is one, exact against transformers; the shared-prefix prompt hits."""
    has_mtp = checkpoint == "tiny_deepseek_dir"
    spec = {"speculative_config": '{"method": "mtp", "num_speculative_tokens": 2}'} if has_mtp else {}
    decode = group(expert_parallel_size=2, **spec)
    with exact_tp_prefill_cluster(
        request, checkpoint, decode, redis_server, tmp_path_factory, prompts, hf_greedy
    ) as (cluster, members):
        decode = members.stats("decode")
        assert len(decode) == 2
        experts = [8, 8] if has_mtp else [6, 6]  # the group's load: its MoE layers' experts
        for s in decode.values():
            assert [len(layer.tokens) for layer in s.expert_load.layers] == experts
            assert all(t > 0 for t in s.expert_load.rank_tokens)
        if has_mtp:
            drafts = "kvferry:spec_decode_num_draft_tokens_total"
            wait_for(lambda: metric(cluster, drafts) >= len(prompts), 10, "the decode ranks' MTP drafts")


@pytest.mark.shared_cluster(**corner(2, 2))
def test_groups_drain_as_one_on_sigterm(cluster_for):
    """SIGTERM to a TP=2 prefill leader and an EP=2 decode group's rank 0 while both decode ranks hold
    requests: every request finishes, then every rank leaves the registry and exits. (The parity test's
    TP=2 x EP=2 cluster, taken: nobody gets it afterwards.)"""
    with cluster_for.take(**corner(2, 2)) as cluster:
        members = Members(cluster)
        meta = MetadataStore(cluster.redis_url, cluster.cfg.namespace)
        try:
            with Client(cluster.router_addr) as client, ThreadPoolExecutor(4) as pool:
                futures = [
                    pool.submit(client.generate, greedy(random_prompt(700 + i, 20), 150), 120)
                    for i in range(4)
                ]

                def held() -> list[list[str]]:
                    return [list(s.active_request_ids) for s in members.stats("decode").values()]

                # every request past its prefill (a draining group takes nothing new: one still in
                # prefill when the signal lands has no decode worker to go to), on both ranks
                wait_for(
                    lambda: all(held()) and sum(map(len, held())) == len(futures),
                    60,
                    "both decode ranks to hold the requests",
                )
                workers = [c for c in cluster.children if c.name in ("prefill-0", "decode-0")]
                for child in workers:
                    child.proc.send_signal(signal.SIGTERM)
                wait_for(
                    lambda: all(r.get("draining") for r in meta.members("decode").values()),
                    10,
                    "the whole decode group to report draining",
                )
                assert [f.result().finished.output_tokens for f in futures] == [150] * 4
            for child in workers:
                assert child.proc.wait(30) == 0
            wait_for(
                lambda: not meta.members("decode") and not meta.members("prefill"), 10, "no members left"
            )
        finally:
            members.close()


def test_mixed_degrees_in_one_cluster(
    redis_server, tiny_model_dir, tmp_path_factory, prompts, reference, hf_greedy
):
    """Prefill groups TP=2 and TP=1, decode groups EP=2 and EP=1 with n-gram speculative decoding (an
    EP group's ranks step in lock-step with drafts in their batches), serving the same requests; the
    looped prompts (a prompt, its continuation, the prompt again) make drafts that are accepted."""
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}'
    looped = [p + r + p for p, r in zip(prompts[:4], reference[:4], strict=True)]
    looped_reference = hf_greedy(tiny_model_dir, looped, NEW_TOKENS)
    with start(
        redis_server,
        tiny_model_dir,
        tmp_path_factory,
        "mixed",
        (group(tensor_parallel_size=2), group()),
        (group(expert_parallel_size=2, speculative_config=ngram), group(speculative_config=ngram)),
    ) as cluster:
        assert cluster.cfg.members("decode") == 3
        for round_ in range(2):  # twice: every group serves some of them
            got = run_all(cluster.router_addr, prompts + looped)
            for i, (tokens, ref) in enumerate(zip(got, reference + looped_reference, strict=True)):
                assert tokens == ref, f"prompt {i} differs in the mixed cluster (round {round_})"
        members = Members(cluster)
        try:
            assert all(s.requests > 0 for s in members.stats("prefill").values())
            assert all(s.requests > 0 for s in members.stats("decode").values())
            degrees = sorted(s.tensor_parallel_size for s in members.stats("prefill").values())
            assert degrees == [1, 2]
            wait_for(
                lambda: metric(cluster, "kvferry:spec_decode_num_draft_tokens_total") > 0,
                15,
                "drafts verified",
            )
        finally:
            members.close()


def test_tp_prefill_pulls_a_prefix_from_the_pool(
    redis_server, tiny_model_dir, tmp_path_factory, prompts, reference
):
    """A TP=2 prefill group whose own prefix cache lost the blocks (8 cache blocks, flushed by other
    prompts) pulls them back from the pool: every rank its KV-head slice, asynchronously, agreed on
    with `pull_done`; the output stays exact."""
    with start(
        redis_server,
        tiny_model_dir,
        tmp_path_factory,
        "tp-pull",
        group(tensor_parallel_size=2, num_kv_blocks=8, max_model_len=128),
        group(max_model_len=128),
    ) as cluster:
        members = Members(cluster)
        try:
            with Client(cluster.router_addr) as client:
                assert client.generate(greedy(prompts[0], NEW_TOKENS), timeout=120).token_ids == reference[0]
                for seed in range(3):  # 12 blocks of other prompts: prompt 0's blocks leave the cache
                    client.generate(greedy(random_prompt(900 + seed, 60), 2), timeout=120)
                before = sum(s.pool_hit_tokens for s in members.stats("prefill").values())
                assert client.generate(greedy(prompts[7], NEW_TOKENS), timeout=120).token_ids == reference[7]
                (stats,) = members.stats("prefill").values()
                assert stats.tensor_parallel_size == 2
                assert stats.pool_hit_tokens - before >= 48  # the shared 3 blocks came from the pool

                def counts() -> tuple[int, int, int]:
                    (s,) = members.stats("prefill").values()
                    return s.local_hit_tokens, s.pool_hit_tokens, s.prompt_tokens_computed

                # a full hit (32 tokens: 2 full blocks) computes only the last token on every rank, whether
                # the blocks are in the group's own cache or come back from the pool
                full = prompts[4]
                assert client.generate(greedy(full, NEW_TOKENS), timeout=120).token_ids == reference[4]
                start_counts = counts()
                assert client.generate(greedy(full, NEW_TOKENS), timeout=120).token_ids == reference[4]
                local = counts()
                assert [b - a for a, b in zip(start_counts, local, strict=True)] == [31, 0, 1]
                for seed in range(3):
                    client.generate(greedy(random_prompt(950 + seed, 60), 2), timeout=120)
                flushed = counts()
                assert client.generate(greedy(full, NEW_TOKENS), timeout=120).token_ids == reference[4]
                assert [b - a for a, b in zip(flushed, counts(), strict=True)] == [0, 31, 1]
            (stats,) = members.stats("prefill").values()
            assert stats.free_blocks == stats.total_blocks  # nothing held after the answers
        finally:
            members.close()
