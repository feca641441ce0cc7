"""A learner that never holds the whole model on one rank (learner/distributed.py ``build_sharded``,
model/weights.py ``load_local`` and ``save_sharded``): each rank reads only its rows of the model dir, the
model dir a save writes comes from every rank without a gather of the model, push-only exports sit beside the
checkpoints (learner/checkpoint.py), and with NCCL a rank takes its GPU before its first collective."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
from safetensors import safe_open

from t1async.learner import ranks as ranks_mod
from t1async.learner.checkpoint import STATE_JSON, list_checkpoints, list_exports, save_checkpoint
from t1async.learner.trainer_config import TrainerConfig
from t1async.model.weights import INDEX_FILE, VALUE_HEAD_FILE, load_local, load_pretrained, local_rows
from t1async.testing.models import tiny_model_dir, transformers_moe_dir
from tests.segments import TCFG, segments


def _tensor_bytes(d) -> int:
    """The bytes of every tensor in a model dir's weight files."""
    n = 0
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118
                sl = h.get_slice(k)
                n += torch.Size(sl.get_shape()).numel() * {"F32": 4, "BF16": 2}[sl.get_dtype()]
    return n


def _assert_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("family", ["ours", "transformers"])
def test_two_ranks_each_read_their_half_and_load_what_one_rank_loads(ranks2, tmp_path, family):
    """Each rank reads about half the bytes of the weight files (its experts, its rows of the rest) and the
    sharded weights equal a plain load bit for bit: a dir we wrote (value head in its own file), and one
    transformers wrote (a dense layer, no value head: the seeded fresh head on both ranks)."""
    ranks, holder = ranks2
    d = tiny_model_dir(tmp_path / "m") if family == "ours" else transformers_moe_dir(tmp_path / "m")
    two = holder["trainer"] = ranks.start(d, TCFG)
    per_rank = two.rank_memory()
    total = _tensor_bytes(d)
    read = [r["read_bytes"] for r in per_rank]
    assert all(0 < r < 0.7 * total for r in read), (read, total)  # no rank reads the model
    assert sum(read) == total  # every row read once, by one rank
    _assert_equal(load_pretrained(d), two.export_model())


def test_two_ranks_write_a_model_dir_without_gathering_it_and_a_push_only_export(ranks2, tmp_path):
    """``save``: each rank writes the tensors it holds whole (its experts) into its own files, listed by one
    index; in bf16 when training in bf16; an export (full=False) has no trainer state and no resume reads it."""
    ranks, holder = ranks2
    d = tiny_model_dir(tmp_path / "m")
    cfg = TrainerConfig(**{**TCFG.__dict__, "train_dtype": "bfloat16"})
    two = holder["trainer"] = ranks.start(d, cfg)
    two.step(segments(load_pretrained(d)), 0)
    root = tmp_path / "ck"
    exp = two.save(root, 1, full=False)
    ck = two.save(root, 2)
    assert [c.policy_version for c in list_checkpoints(root)] == [2] and list_exports(root) == [exp.path]
    assert not (exp.path / STATE_JSON).exists() and not (exp.path / "dcp").exists()
    assert (ck.path / STATE_JSON).is_file() and (ck.path / "dcp").is_dir()
    index = json.loads((exp.path / INDEX_FILE).read_text())["weight_map"]
    files = set(index.values())
    assert len(files) == 2, files  # rank 0's file and rank 1's
    e = load_pretrained(d).cfg.n_experts
    by_file = {f: [k for k, v in index.items() if v == f and ".experts." in k] for f in files}
    owners = {f: sorted({int(k.split(".experts.")[1].split(".")[0]) for k in ks}) for f, ks in by_file.items()}
    assert sorted(owners.values()) == [list(range(e // 2)), list(range(e // 2, e))], owners  # experts stay home
    for f in files:
        with safe_open(str(exp.path / f), "pt") as h:
            assert {h.get_slice(k).get_dtype() for k in h.keys()} == {"BF16"}  # noqa: SIM118
    full = two.export_model()
    want = {k: v.to(torch.bfloat16) for k, v in full.state_dict().items()}
    got = load_pretrained(exp.path, torch.bfloat16).state_dict()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert (exp.path / VALUE_HEAD_FILE).is_file()


def test_exports_are_pruned_and_a_lost_future_is_replaced(tmp_path):
    """Exports between checkpoints keep the newest ``keep``; an export at or past the version being written
    (left by a run that crashed before its next checkpoint) is replaced, while a checkpoint is never."""
    d = tiny_model_dir(tmp_path / "m")
    model = load_pretrained(d)
    root = tmp_path / "ck"
    for v in (1, 2, 3, 4):
        save_checkpoint(root, model, None, policy_version=v, step=v, keep=2, full=v == 2)
    assert [p.name for p in list_exports(root)] == ["v000003", "v000004"]
    assert [c.policy_version for c in list_checkpoints(root)] == [2]
    # resumed from v2: the crashed run's v3 and v4 exports are replaced as the new run writes v3
    save_checkpoint(root, model, None, policy_version=3, step=3, keep=2, full=False)
    assert [p.name for p in list_exports(root)] == ["v000003"]
    with pytest.raises(Exception, match="already exists"):
        save_checkpoint(root, model, None, policy_version=2, step=2, keep=2, full=False)
    _assert_equal(load_pretrained(root / "v000003"), model)


def test_a_plain_load_reads_straight_into_the_model(tmp_path):
    """One process: ``load_local`` reads every row once, into the model's own tensors (no second copy)."""
    d = tiny_model_dir(tmp_path / "m")
    model = load_pretrained(d)
    ptr = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert load_local(model, d) == _tensor_bytes(d)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptr
    t, lo = local_rows(model.embed.weight)
    assert t is model.embed.weight and lo == 0


def test_an_nccl_rank_takes_its_gpu_before_its_first_collective(monkeypatch):
    """``join`` with NCCL: set_device(LOCAL_RANK) comes first, then the group is made with that device_id; no
    collective can run before it (the old order made every rank meet on cuda:0). A recorder stands in for the
    GPU and the group (there is no GPU here)."""
    calls: list[tuple] = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))

    def init(backend, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append(("init_process_group", backend, kw.get("device_id")))

    monkeypatch.setattr(ranks_mod.dist, "init_process_group", init)
    monkeypatch.setattr(ranks_mod.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(ranks_mod.dist, "get_world_size", lambda: 2)
    assert ranks_mod.join(backend="nccl", timeout_s=5) == (1, 2)
    assert calls == [("set_device", 1), ("init_process_group", "nccl", torch.device("cuda", 1))]
    calls.clear()
    monkeypatch.setenv("LOCAL_RANK", "2")  # more ranks than GPUs on this host: one line, before any group
    with pytest.raises(Exception, match="LOCAL_RANK 2 but this host has 2 GPU"):
        ranks_mod.join(backend="nccl", timeout_s=5)
    assert calls == []
    ranks_mod.join(backend="gloo", timeout_s=timedelta(seconds=5).total_seconds())
    assert calls == [("init_process_group", "gloo", None)]  # gloo: no GPU taken
