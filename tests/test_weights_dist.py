"""SGLang's distributed weight update for real: the learner side in this process (rank 0 of a gloo group on
127.0.0.1), a real embedded sampler server process (rank 1), weights broadcast in buckets between
/pause_generation and /continue_generation (design §10)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from t1async.learner.weightpush import DistributedPusher, WeightPushConfig, buckets
from t1async.model.weights import default_model_dir, load_pretrained, save_pretrained
from t1async.protocol.errors import ConfigError, SamplerError
from t1async.protocol.sampling import SamplingParams
from t1async.sampler import weightpush as W
from t1async.sampler.client import SGLangClient

PROMPT = [5, 17, 99, 230, 7, 64, 301, 12]


@pytest.fixture
def own_sampler(tmp_path):
    """A sampler process of our own (these tests change its weights; it loads from under tmp_path)."""
    from t1async.sampler.launch import SamplerProcess

    proc = SamplerProcess(max_batch=8, allowed_weight_roots=(tmp_path,))
    try:
        yield proc.start()
    finally:
        proc.stop()


def _perturbed(seed: int) -> torch.nn.Module:
    model = load_pretrained(default_model_dir())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


async def _logprobs(client: SGLangClient) -> tuple[np.ndarray, np.ndarray, int]:
    gen = await client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0, seed=1))
    return gen.output_ids, gen.logprobs, gen.policy_version


async def _version(client: SGLangClient) -> str:
    async with __import__("httpx").AsyncClient() as http:
        return str((await http.get(client.urls[0] + "/get_model_info")).json()["weight_version"])


async def test_distributed_push_lands_the_same_weights_as_disk(own_sampler, tmp_path):
    model = _perturbed(3)
    async with SGLangClient([own_sampler]) as client:
        ids0, lp0, _ = await _logprobs(client)
        pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=0.25))  # several buckets
        try:
            out = await pusher.push(model, policy_version=5)
            assert out["buckets"] > 1
            assert await _version(client) == "5"
            ids1, lp1, v1 = await _logprobs(client)
            assert v1 == 5
            assert not (np.array_equal(ids0, ids1) and np.allclose(lp0, lp1))  # the weights did change
            # the same weights through the disk path give the same tokens and logprobs
            await client.update_weights_from_disk(str(save_pretrained(model, tmp_path / "m")), 6)
            ids2, lp2, v2 = await _logprobs(client)
            assert v2 == 6 and np.array_equal(ids1, ids2)
            np.testing.assert_allclose(lp1, lp2, rtol=0, atol=1e-6)
            # a second push over the same group: back to the shipped weights
            await pusher.push(load_pretrained(default_model_dir()), policy_version=7)
            ids3, lp3, v3 = await _logprobs(client)
            assert v3 == 7 and np.array_equal(ids0, ids3)
            np.testing.assert_allclose(lp0, lp3, rtol=0, atol=1e-6)
        finally:
            await pusher.aclose()


async def test_paused_sampler_stages_buckets_and_holds_new_requests_until_continue(own_sampler):
    model = _perturbed(4)
    async with SGLangClient([own_sampler]) as client:
        pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=0.25))
        await pusher.connect()
        try:
            await W.pause_generation(client)
            await W.begin_weight_update(client, own_sampler)
            got: dict = {}
            async with anyio.create_task_group() as tg:

                async def gen() -> None:
                    got["v"] = (await _logprobs(client))[2]

                tg.start_soon(gen)  # sent after the pause: it waits at the gate
                named = [(k, v.detach().contiguous()) for k, v in model.state_dict().items()]
                for part in buckets(named, 0.25):
                    await pusher._bucket(part, 9)
                assert await _version(client) == "0"  # staged, not applied while paused
                assert "v" not in got
                await W.end_weight_update(client, own_sampler)
                await W.continue_generation(client)
            assert got["v"] == 9  # the held request ran on the whole new weights
            assert await _version(client) == "9"
        finally:
            await pusher.aclose()


async def test_bad_updates_are_clear_errors_and_leave_the_weights(own_sampler):
    async with SGLangClient([own_sampler]) as client:
        with pytest.raises(SamplerError, match="init_weights_update_group first"):
            await W.update_weights_from_distributed(
                client, own_sampler, names=["a"], dtypes=["float32"], shapes=[[2]], group_name="nope"
            )
        with pytest.raises(SamplerError, match="unknown dtype"):
            await W.update_weights_from_distributed(client, own_sampler, names=["a"], dtypes=["int7"], shapes=[[2]])
        with pytest.raises(SamplerError, match="use backend 'gloo'"):
            await W.init_weights_update_group(
                client,
                own_sampler,
                master_address="127.0.0.1",
                master_port=1,
                rank_offset=1,
                world_size=2,
                backend="nccl",
            )
        ids0, lp0, v0 = await _logprobs(client)
        bogus = torch.nn.Module()
        bogus.register_buffer("not_a_weight", torch.ones(3))
        pusher = DistributedPusher(client, WeightPushConfig())
        with pytest.raises(SamplerError, match="names not in the model"):
            await pusher.push(bogus, policy_version=3)  # received, then rejected; the sampler is continued
        ids1, lp1, v1 = await _logprobs(client)
        assert v1 == v0 and np.array_equal(ids0, ids1)
        np.testing.assert_allclose(lp0, lp1, rtol=0, atol=1e-6)
        # the failed push dropped its group: the next push makes a new one and works
        try:
            await pusher.push(_perturbed(5), policy_version=4)
            assert (await _logprobs(client))[2] == 4
        finally:
            await pusher.aclose()


def test_buckets_and_config():
    t = [("a", torch.zeros(256)), ("b", torch.zeros(256)), ("c", torch.zeros(1024)), ("d", torch.zeros(1))]
    parts = buckets(t, 2048 / 2**20)  # 2 KiB: a+b (1 KiB each), c alone (4 KiB), d
    assert [[n for n, _ in p] for p in parts] == [["a", "b"], ["c"], ["d"]]
    with pytest.raises(ConfigError, match="weight-bucket-mb"):
        WeightPushConfig(bucket_mb=0)


async def test_learner_pushes_each_version_over_the_group(tmp_path):
    """The real learner service (in-memory NATS, real trainer) with --weight-sync distributed, and a real
    sampler process that the actor samples from: every step's version reaches the sampler over the gloo
    group, and the sampler ends with exactly the weights of the learner's last checkpoint."""
    from actors.actor import run_actor
    from actors.settings import ActorSettings
    from sandbox_agent.agent.types import AgentConfig
    from sandbox_agent.synth import generate
    from t1async.learner.checkpoint import latest_checkpoint
    from t1async.learner.service import Learner
    from t1async.learner.settings import LearnerConfig
    from t1async.model.config import MoEConfig
    from t1async.model.moe import MoETransformer
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.sampler.launch import SamplerProcess
    from t1async.transport import MemoryBroker, MemoryTransport

    tok = ChatTokenizer.load()
    model_dir = tmp_path / "model"
    cfg = MoEConfig(
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=2,
        n_experts=4,
        top_k=2,
        d_ff=32,
        max_seq_len=8192,
        seed=0,
    )
    save_pretrained(MoETransformer(cfg), model_dir, tok)
    generate(tmp_path / "tasks", 6, seed=3)
    proc = SamplerProcess(model_dir, max_batch=8)
    url = proc.start()
    try:
        lcfg = LearnerConfig(
            run_dir=tmp_path / "run",
            model=model_dir,
            max_staleness=1,
            batch_turns=4,
            steps=2,
            lease=30.0,
            metrics_every_s=0.2,
            lr=1e-2,
        )
        agent = AgentConfig(
            max_turns=3,
            max_context_tokens=4096,
            command_timeout_s=5.0,
            sampling=SamplingParams(max_new_tokens=24, stop_token_ids=tuple(tok.eos_ids)),
        )
        broker = MemoryBroker()
        async with SGLangClient([url]) as client, MemoryTransport(broker) as lt, MemoryTransport(broker) as at:
            learner = Learner(lcfg, lt, client)
            learner.weight_pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=0.05))
            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(learner.run)
                    tg.start_soon(
                        lambda: run_actor(
                            ActorSettings(actor_id="a1", tasks=tmp_path / "tasks", concurrency=3, split="all"),
                            transport=at,
                            sampler=client,
                            tokenizer=tok,
                            agent=agent,
                        )
                    )
                    with anyio.fail_after(300):
                        while learner.weight_pusher.pushes < 2:  # the step counts before its push
                            await anyio.sleep(0.1)
                    tg.cancel_scope.cancel()
                assert learner.weight_pusher.pushes == 2 and learner.weight_pusher.last["buckets"] > 1
                assert await _version(client) == "2"
                ids1, lp1, v1 = await _logprobs(client)
                assert v1 == 2
                ckpt = latest_checkpoint(lcfg.checkpoints)
                assert ckpt.policy_version == 2
                await client.update_weights_from_disk(str(ckpt.path), 3)  # the checkpoint through the disk path
                ids2, lp2, v2 = await _logprobs(client)
                assert v2 == 3 and np.array_equal(ids1, ids2)
                np.testing.assert_allclose(lp1, lp2, rtol=0, atol=1e-6)
            finally:
                await learner.weight_pusher.aclose()
                learner.journal.close()
    finally:
        proc.stop()


async def test_a_pause_without_continue_ends_by_itself_and_drops_that_push():
    """A trainer that dies mid-push must not stall every actor: the pause expires, the old weights serve,
    and the rest of that push is refused until the next pause; a whole push then works."""
    from t1async.sampler.server import serve
    from t1async.sampler.settings import SamplerSettings

    with anyio.fail_after(240):  # without the expiry the held request would wait forever
        await _expiring_pause(serve, SamplerSettings)


async def _expiring_pause(serve, SamplerSettings) -> None:
    async with anyio.create_task_group() as tg:
        url = await tg.start(serve, SamplerSettings(port=0, max_batch=4, pause_timeout=1.0))
        async with SGLangClient([url]) as client:
            ids0, lp0, _ = await _logprobs(client)
            model = _perturbed(6)
            pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=0.25))
            await pusher.connect()
            named = [(k, v.detach().contiguous()) for k, v in model.state_dict().items()]
            parts = buckets(named, 0.25)
            await W.pause_generation(client)
            await W.begin_weight_update(client, url)
            await pusher._bucket(parts[0], 1)  # staged; then the "trainer" goes silent
            ids1, lp1, v1 = await _logprobs(client)  # held, until the pause expires
            assert v1 == 0 and np.array_equal(ids0, ids1)
            np.testing.assert_allclose(lp0, lp1, rtol=0, atol=1e-6)
            with pytest.raises(SamplerError, match="pause ended"):
                await pusher._bucket(parts[1], 1)  # received (the broadcast does not hang), refused
            with pytest.raises(SamplerError, match="pause ended"):
                await W.continue_generation(client)
            assert await _version(client) == "0"
            await pusher.push(model, policy_version=2)  # the group still works: a whole push lands
            assert (await _logprobs(client))[2] == 2
            await pusher.aclose()
        tg.cancel_scope.cancel()


async def test_a_restarted_sampler_rejoins_at_the_next_push(tmp_path):
    """A sampler that restarted has no group: the push fails there, and is tried once more over a new group
    that the new sampler process joins."""
    from t1async.sampler.launch import SamplerProcess

    proc = SamplerProcess(max_batch=4)
    url = proc.start()
    port = int(url.rsplit(":", 1)[1])
    model = _perturbed(7)
    try:
        async with SGLangClient([url]) as client:
            pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=0.25))
            await pusher.push(model, policy_version=1)
            proc.stop()
            proc = SamplerProcess(max_batch=4, port=port)  # the same URL, a fresh process: no group
            assert proc.start() == url
            assert await _version(client) == "0"
            await pusher.push(model, policy_version=2)
            assert (await _logprobs(client))[2] == 2
            await pusher.aclose()
    finally:
        proc.stop()


async def test_one_push_reaches_every_sampler():
    """Two sampler processes are ranks 1 and 2 of one group; one push lands the same weights on both."""
    from t1async.sampler.launch import SamplerProcess

    procs = [SamplerProcess(max_batch=4), SamplerProcess(max_batch=4)]
    try:
        urls = [p.start() for p in procs]
        model = _perturbed(8)
        async with SGLangClient(urls) as both, SGLangClient(urls[:1]) as a, SGLangClient(urls[1:]) as b:
            before = await _logprobs(a)
            pusher = DistributedPusher(both, WeightPushConfig(bucket_mb=0.25))
            try:
                await pusher.push(model, policy_version=3)
            finally:
                await pusher.aclose()
            (ia, la, va), (ib, lb, vb) = await _logprobs(a), await _logprobs(b)
            assert va == vb == 3 and np.array_equal(ia, ib)
            np.testing.assert_allclose(la, lb, rtol=0, atol=1e-6)
            assert not (np.array_equal(before[0], ia) and np.allclose(before[1], la))
    finally:
        for p in procs:
            p.stop()


async def test_a_dead_sampler_is_left_out_and_taken_in_when_it_is_back():
    """As with the disk path, a sampler that is down does not stop the push to the others; when it answers
    again, the next push makes a new group that takes it in."""
    from t1async.sampler.launch import SamplerProcess

    procs = [SamplerProcess(max_batch=4), SamplerProcess(max_batch=4)]
    try:
        urls = [p.start() for p in procs]
        port = int(urls[1].rsplit(":", 1)[1])
        procs[1].stop()
        model = _perturbed(9)
        async with SGLangClient(urls) as both, SGLangClient(urls[:1]) as a, SGLangClient(urls[1:]) as b:
            pusher = DistributedPusher(both, WeightPushConfig(bucket_mb=0.25))
            try:
                await pusher.push(model, policy_version=1)
                assert pusher.members == urls[:1] and (await _logprobs(a))[2] == 1
                procs[1] = SamplerProcess(max_batch=4, port=port)
                assert procs[1].start() == urls[1]
                await pusher.push(model, policy_version=2)
                assert pusher.members == urls
                (ia, la, va), (ib, lb, vb) = await _logprobs(a), await _logprobs(b)
                assert va == vb == 2 and np.array_equal(ia, ib)
                np.testing.assert_allclose(la, lb, rtol=0, atol=1e-6)
            finally:
                await pusher.aclose()
    finally:
        for p in procs:
            p.stop()


async def test_a_learner_on_a_hugging_face_checkpoint_pushes_hub_names(tmp_path):
    """A learner holding a transformers-built Qwen3-MoE (a dense layer among the MoE ones) pushes under the
    hub names SGLang loads (no ``blocks.*``, no value head), and the sampler's weights become the learner's
    exactly (seen failing on the old code: it sent our fused ``blocks.N.attn.qkv.weight`` names)."""
    import httpx
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from t1async.learner.trainer import Trainer
    from t1async.model.engine import Engine
    from t1async.model.hf import hf_slots
    from t1async.model.records import EngineConfig
    from t1async.sampler.server import build_app

    hf_cfg = Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        num_experts=6,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).save_pretrained(tmp_path / "v0")
    trainer = Trainer(load_pretrained(tmp_path / "v0"))  # the learner's model and optimizer
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # stands for a training step: every weight moves
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)

    engine = Engine(tmp_path / "v0", EngineConfig(max_batch=2))
    received: list[str] = []
    apply = engine.update_weights_from_tensors

    async def spy(tensors: dict[str, torch.Tensor], weight_version: str | None = None) -> None:
        received.extend(tensors)
        await apply(tensors, weight_version=weight_version)

    engine.update_weights_from_tensors = spy  # type: ignore[method-assign]
    app = build_app(engine, engine.tokenizer)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        client = SGLangClient(["http://sampler"], transport=httpx.ASGITransport(app=app))
        async with client:
            pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=0.05))
            try:
                out = await pusher.push(trainer.export_model(), policy_version=1)
            finally:
                await pusher.aclose()
        tg.cancel_scope.cancel()
    assert out["buckets"] > 1
    assert sorted(received) == sorted(hf_slots(trainer.model.cfg))  # every hub name once, nothing else
    assert "model.layers.1.mlp.gate_proj.weight" in received  # the dense layer under its own names
    served = engine._core.model.state_dict()
    learner = trainer.model.state_dict()
    for k, v in learner.items():
        if not k.startswith("value_head."):
            assert torch.equal(served[k], v), k
