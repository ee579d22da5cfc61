"""Layer-wise KV streaming from the prefill worker (`prefill_worker/streaming.py`), in a real cluster:
a prompt prefilled in several chunks has every full block written to the pool layer by layer during
its steps, the decode worker pulls all of it (nothing recomputed), and the tokens match transformers;
with streaming off the same blocks are written after the prefill."""

from __future__ import annotations

import pytest
import torch
from cluster_helpers import Members, make_cluster_config, wait_for

from kvferry.deploy.config import PoolConfig, WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.engine.block_hash import block_keys
from kvferry.kvpool.metadata import DISK_SLOT, MetadataStore
from kvferry.router.client import Client, build_request

pytestmark = pytest.mark.slow

# 32-token steps: a 100-token prompt is prefilled in 4 chunks
CHUNKED = {"max_model_len": 1024, "num_kv_blocks": 256, "max_num_batched_tokens": 32}


@pytest.mark.parametrize(
    "mode, shm, stream",
    [("on", True, True), ("on", False, True), ("off", True, False), ("auto", True, False)],
    ids=["on-shm", "on-pair", "off", "auto-cpu"],
)
def test_chunked_prompt_streams_its_blocks(
    redis_server, tiny_model_dir, tmp_path, hf_greedy, mode, shm, stream
):
    """Through the shared slab and the pair group; `auto` does not stream on CPU."""
    cfg = make_cluster_config(
        tiny_model_dir,
        redis_server.url,
        f"test-stream-{mode}-{shm}",
        pool=PoolConfig(nodes=1, memory_gib=0.1, stream_layers=mode, shm=shm),
        prefill=WorkerGroupSettings(replicas=1, engine=CHUNKED),
        decode=WorkerGroupSettings(replicas=1, engine=CHUNKED),
    )
    prompts = [
        torch.randint(3, 8192, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (100, 64)
    ]
    refs = hf_greedy(tiny_model_dir, prompts, 6)
    with LocalCluster(cfg, log_dir=tmp_path, quiet=True) as cluster, Client(cluster.router_addr) as api:
        members = Members(cluster)
        meta = MetadataStore(cluster.redis_url, cfg.namespace)
        try:
            for prompt, ref in zip(prompts, refs, strict=True):
                request = build_request(
                    prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True
                )
                assert api.generate(request, timeout=60).token_ids == ref
            (prefill,) = members.stats("prefill").values()
            (decode,) = members.stats("decode").values()
            full = 100 // 16 + 64 // 16
            assert prefill.blocks_streamed == (full if stream else 0)
            assert prefill.blocks_put == full + 1  # and the 100-token prompt's private tail
            assert decode.pool_hit_tokens == 164 and decode.recomputed_tokens == 0
            keys = block_keys(prompts[0], 16, bytes.fromhex(api.model_info().fingerprint))
            wait_for(lambda: len(meta.lookup_prefix(keys)) == 6, 10, "the streamed blocks to be published")
        finally:
            members.close()


def test_latent_int8_blocks_stream_spill_to_disk_and_come_back(redis_server, tiny_deepseek_dir, tmp_path):
    """DeepSeek-V3's latent blocks, in int8 with their scales and the MTP layer's rows among them, take
    the paths any block takes: streamed layer by layer from a chunked prefill, evicted from a small pool
    node to its disk tier, restored from there for a later prompt sharing the first one's prefix (the
    workers' own caches too small to still hold it). The tokens are the offline int8 engine's."""
    from kvferry.engine.engine import EngineConfig, LLMEngine
    from kvferry.engine.request import SamplingParams

    small = {"max_model_len": 128, "num_kv_blocks": 16, "max_num_batched_tokens": 32}
    cfg = make_cluster_config(
        tiny_deepseek_dir,
        redis_server.url,
        "test-stream-latent",
        # the smallest node (16 slots): five 100-token prompts push the first one's blocks to disk
        pool=PoolConfig(
            nodes=1, memory_gib=1e-6, stream_layers="on", disk_dir=str(tmp_path / "disk"), disk_max_gib=0.01
        ),
        prefill=WorkerGroupSettings(replicas=1, engine=small),
        decode=WorkerGroupSettings(replicas=1, engine=small),
    ).with_overrides(kv_cache_dtype="int8")
    offline = LLMEngine(
        EngineConfig(model=str(tiny_deepseek_dir), dtype="float32", max_model_len=128, kv_cache_dtype="int8"),
        detokenize=False,
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 8000, (100,), generator=gen).tolist() for _ in range(5)]
    again = [*prompts[0][:96], 5, 6, 7, 8]
    with (
        LocalCluster(cfg, log_dir=tmp_path / "logs", quiet=True) as cluster,
        Client(cluster.router_addr) as api,
    ):
        members = Members(cluster)
        try:

            def ask(prompt):
                request = build_request(
                    prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True
                )
                got = api.generate(request, timeout=60)
                (want,) = offline.generate([{"prompt_token_ids": prompt}], params)
                assert got.token_ids == want.output_token_ids
                return got

            for prompt in prompts:
                ask(prompt)

            # 30 blocks through 16 slots: the first prompt's 6, the least recently used, are on disk now
            keys = block_keys(prompts[0], 16, bytes.fromhex(api.model_info().fingerprint))[:6]
            meta = MetadataStore(cluster.redis_url, cfg.namespace)

            def on_disk():
                found = meta.lookup_prefix(keys)
                return len(found) == 6 and all(loc.slot == DISK_SLOT for loc in found)

            wait_for(on_disk, 30, "the first prompt's blocks named on disk")
            got = ask(again)
            assert got.finished.pool_cached_tokens > 0  # its prefix came back from the pool, not recomputed
            (node,) = members.stats("pool").values()
            assert node.disk_hits > 0 and node.disk_corrupt == 0 and node.dtype == "int8"
            (prefill,) = members.stats("prefill").values()
            assert prefill.blocks_streamed >= 5 * 6
        finally:
            members.close()
