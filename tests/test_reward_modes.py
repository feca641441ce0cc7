"""The reward option (``--reward dense|binary``, design §8) and the ``cdchores`` family, where a setup step
earns nothing by itself: the family's oracle resolves in the real sandbox, its ``cd`` turn earns 0 under the
dense reward and enables the rest, and the binary reward pays only the last turn, 1 if resolved."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from sandbox_agent.agent.runner import check_tasks, oracle_turns, run_episode, solution_chunks
from sandbox_agent.agent.types import AgentConfig, Reward, TurnResult
from sandbox_agent.synth import generate, make_task, task_rng
from sandbox_agent.synth.cdchores import DIRS, content_key
from sandbox_agent.synth.chores import MENU
from sandbox_agent.tasks.task import load_task
from tests.scripted_episode import ByteTok, ScriptedSampler, bash, episode

PHRASE_INDEX = {phrase: i for i, (phrase, _, _, _) in enumerate(MENU)}

# ------------------------------------------------------------------------------ the agent loop's rewards


async def test_binary_reward_pays_only_the_last_turn_one_if_resolved():
    replies = [bash("touch t0"), bash("touch t1"), bash("touch t2"), "DONE"]
    cfg = AgentConfig(verify_every=1, stop_when_resolved=False, reward=Reward.BINARY)
    res, turns, _, _, _ = await episode(replies, config=cfg)
    assert [t.tests_passed for t in turns] == [1, 2, 3, 3]  # still verified every turn
    assert [t.reward for t in turns] == [0, 0, 0, 1] and res.resolved and res.unstreamed_reward == 0
    dense, dturns, _, _, _ = await episode(replies, config=AgentConfig(verify_every=1, stop_when_resolved=False))
    assert [t.reward for t in dturns] == [1, 1, 1, 0] and dense.tests_passed == 3


async def test_binary_reward_is_zero_when_not_all_tests_pass():
    replies = [bash("touch t0"), bash("touch t1"), "DONE"]
    for every in (0, 1):
        res, turns, _, _, _ = await episode(replies, config=AgentConfig(verify_every=every, reward=Reward.BINARY))
        assert res.tests_passed == 2 and not res.resolved
        assert [t.reward for t in turns] == [0, 0, 0] and res.unstreamed_reward == 0


async def test_binary_reward_resolved_by_a_periodic_check_ends_with_one():
    replies = [bash("touch t0"), bash("touch t1"), bash("touch t2"), bash("echo more")]
    res, turns, _, _, _ = await episode(replies, config=AgentConfig(verify_every=1, reward=Reward.BINARY))
    assert res.reason == "solved" and len(turns) == 3 and [t.reward for t in turns] == [0, 0, 1]


async def test_binary_reward_of_an_unverified_end_is_the_unstreamed_reward():
    """A sampler failure ends the episode before a turn could carry the final verification: its 1 (or 0) is
    the unstreamed reward, as the dense change would be."""
    tok = ByteTok()
    replies = [bash("touch t0"), bash("touch t1"), bash("touch t2")]
    for reward, want in ((Reward.BINARY, 1.0), (Reward.DENSE, 3.0)):
        res, turns, _, _, _ = await episode(
            None, sampler=ScriptedSampler(tok, replies, fail_at=3), config=AgentConfig(reward=reward)
        )
        assert res.reason == "error" and res.resolved and [t.reward for t in turns] == [0, 0, 0]
        assert res.unstreamed_reward == want


def test_reward_flag_reaches_the_actors_agent_config(tmp_path):
    """``cluster up --reward binary`` -> the actors' TOML -> the actor's AgentConfig; a bad value is refused."""
    from actors.__main__ import agent_config, build_parser, settings
    from t1async.cluster.components import specs
    from t1async.cluster.config import UpConfig
    from t1async.config import from_mapping
    from t1async.protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="reward"):
        from_mapping(UpConfig, {"reward": "sparse"}, where="")
    for value in (Reward.BINARY, Reward.DENSE, Reward.TURNS):
        cfg = UpConfig(run_dir=tmp_path, sampler_url=("http://127.0.0.1:1",), reward=value).check()
        actor = next(s for s in specs(cfg, "nats://127.0.0.1:1") if s.name == "actor-0")
        p = build_parser()
        args = settings(p.parse_args(actor.argv[actor.argv.index("actors") + 1 :]), p)
        assert args.reward == value and agent_config(args, (1,)).reward == value
    p = build_parser()
    help_text = p.format_help()
    assert "--reward {dense,binary,turns}" in help_text and "1 if all tests pass at the end" in " ".join(
        help_text.split()
    )


# ------------------------------------------------------------------------------ the cdchores family


def test_cdchores_content_key_names_the_directory_and_the_chore_set():
    keys = [content_key(task_rng(0, i, "cdchores")) for i in range(400)]
    assert keys == [content_key(task_rng(0, i, "cdchores")) for i in range(400)]  # deterministic
    assert {k.split(":")[1] for k in keys} == set(DIRS)
    assert 200 < len(set(keys)) <= 4 * 126  # 4 directories x C(9,4) chore sets
    # two tasks with one key are the same task: the same directory and chores, maybe in another order
    by_key: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    i, j = next(v for v in by_key.values() if len(v) > 1)[:2]
    a, b = make_task("cdchores", 0, i)[1], make_task("cdchores", 0, j)[1]

    def chores(instruction: str) -> list[str]:
        return sorted(ln.split(". ", 1)[1].rstrip(";.") for ln in instruction.splitlines()[1:])

    assert a.instruction.splitlines()[0] == b.instruction.splitlines()[0]  # "In the directory site:"
    assert chores(a.instruction) == chores(b.instruction)
    assert Counter(k.split(":")[1] for k in keys).most_common()[-1][1] > 60  # every directory drawn often
    # and the split holds it out whole: the task's own key is this one (it was a digest of its test file, which
    # differs with the order of the chores, so one chore set in one directory fell in several splits)
    for i in range(40):
        spec = make_task("cdchores", 0, i)[1]
        assert spec.content_key == keys[i]


def test_cdchores_oracle_is_a_setup_turn_then_two_chore_turns(tmp_path):
    (p,) = generate(tmp_path, 1, seed=0, families=["cdchores"])
    task = load_task(p)
    target = task.instruction.splitlines()[0].removeprefix("In the directory ").rstrip(":")
    chunks = solution_chunks(task.solution.read_text())
    assert chunks[0] == f"cd {target}" and len(chunks) == 3
    assert all(len(c.splitlines()) == 2 for c in chunks[1:])


async def test_cdchores_oracle_resolves_and_null_does_not(tmp_path):
    paths = generate(tmp_path, 8, seed=3, families=["cdchores"])
    rows = await check_tasks([load_task(q) for q in paths], concurrency=3)
    bad = {r.task_id: (r.oracle.passed, r.oracle.total, r.null.passed) for r in rows if not r.ok}
    assert bad == {} and all(r.oracle.total == 4 and r.null.passed == 0 for r in rows)


async def test_cdchores_oracle_turns_make_a_demo(tmp_path):
    """The warm start's SFT demos come from ``oracle_turns``: the cd, two chore turns, DONE, all resolving."""
    (p,) = generate(tmp_path, 1, seed=1, families=["cdchores"])
    turns, result = await oracle_turns(load_task(p))
    assert [t[0].startswith("```bash\ncd ") for t in turns] == [True, False, False, False]
    assert turns[-1] == ("DONE", "") and result.resolved and result.passed == 4


async def _scripted(task_dir: Path, commands: list[str], reward: Reward) -> tuple[list[TurnResult], object]:
    tok = ByteTok()
    turns: list[TurnResult] = []

    async def on_turn(t: TurnResult) -> None:
        turns.append(t)

    res = await run_episode(
        load_task(task_dir),
        sampler=ScriptedSampler(tok, [bash(c) for c in commands] + ["DONE"]),
        tokenizer=tok,
        config=AgentConfig(verify_every=1, stop_when_resolved=False, reward=reward),
        on_turn=on_turn,
    )
    return turns, res


async def test_cdchores_setup_turn_earns_nothing_yet_enables_every_test(tmp_path):
    """In the real sandbox: the dense reward gives the ``cd`` 0 and the chores after it 2 + 2; the same
    chores without the ``cd`` earn nothing; the binary reward pays 1 on the last turn only."""
    (p,) = generate(tmp_path, 1, seed=2, families=["cdchores"])
    chunks = solution_chunks(load_task(p).solution.read_text())
    turns, res = await _scripted(p, chunks, Reward.DENSE)
    assert [t.reward for t in turns] == [0, 2, 2, 0] and res.resolved
    turns, res = await _scripted(p, chunks[1:], Reward.DENSE)  # no setup step: the chores miss the directory
    assert [t.reward for t in turns] == [0, 0, 0] and res.tests_passed == 0
    turns, res = await _scripted(p, chunks, Reward.BINARY)
    assert [t.reward for t in turns] == [0, 0, 0, 1] and res.resolved
    turns, res = await _scripted(p, chunks[:2], Reward.BINARY)  # half done: tests 2 of 4, reward 0
    assert [t.reward for t in turns] == [0, 0, 0] and res.tests_passed == 2


async def test_cdchores_chores_done_in_every_directory_fail(tmp_path):
    (p,) = generate(tmp_path, 1, seed=4, families=["cdchores"])
    chores = "\n".join(solution_chunks(load_task(p).solution.read_text())[1:])
    spray = f"for d in {' '.join(DIRS)}; do (cd $d && {chores.replace(chr(10), ' && ')}); done"
    turns, res = await _scripted(p, [spray], Reward.DENSE)
    assert res.tests_passed == 0 and res.tests_total == 4


def test_reward_modes_bench_holds_out_by_content(tmp_path):
    """bench.reward_modes: the held-out tasks are the eval split of a corpus split by content, and no held-out
    key is in a train task or a demo; a demo of a held-out key is refused."""
    from bench.reward_modes import held_out_corpus
    from sandbox_agent.synth import corpus_entries

    sft = corpus_entries(200, 1000, ["cdchoresome"])
    tasks_dir, held = held_out_corpus(tmp_path, 300, 0, sft)
    left = [load_task(d) for d in tasks_dir.iterdir() if d.is_dir()]  # not split.json
    held_keys = {t.content_key for t in held}
    assert held and all(t.split == "eval" and t.family == "cdchores" for t in held)
    assert len(left) == 300 and not held_keys & {t.content_key for t in left if t.split == "train"}
    assert not held_keys & {k for s, k, _ in sft.values() if s == "train"}
    assert json.loads((tmp_path / "split.json").read_text())["split_disjoint"] is True
    leaked = {**sft, "demo-of-a-held-key": ("train", held[0].content_key, "cdchoresome")}
    with pytest.raises(SystemExit, match="NOT disjoint"):
        held_out_corpus(tmp_path, 300, 0, leaked)


@pytest.mark.parametrize("family, ks_seen", [("cdchoresome", {1, 2, 3, 4}), ("cdchoresfew", {1, 2, 3})])
def test_weaker_demonstrators_ask_for_cdchores_tasks_and_do_the_cd_then_their_first_k(family, ks_seen):
    """The credit warm starts' demonstrators: the same directory and four chores asked for (one content key
    space with cdchores), the ``cd`` first, then the first k chores two a reply, and only those k tested.
    ``cdchoresfew`` (the credit-rare warm start's) never does all four."""
    ks = Counter()
    for i in range(400):
        spec = make_task(family, 0, i)[1]
        target = spec.instruction.splitlines()[0].removeprefix("In the directory ").rstrip(":")
        chosen = sorted(PHRASE_INDEX[ln.split(". ", 1)[1].rstrip(";.")] for ln in spec.instruction.splitlines()[1:])
        assert spec.content_key == f"cdchores:{target}:" + ",".join(map(str, chosen))
        k = spec.tests.count("def test_chore_")
        ks[k] += 1
        replies = solution_chunks(spec.solution)
        assert replies[0] == f"cd {target}"
        assert [len(r.splitlines()) for r in replies[1:]] == [min(k, 2)] + ([k - 2] if k > 2 else [])
    assert set(ks) == ks_seen and ks[2] > ks[3] + ks[4]  # mostly it stops after its first chore reply


@pytest.mark.parametrize("family", ["cdchoresome", "cdchoresfew"])
async def test_weaker_demonstrators_resolve_their_own_tests(tmp_path, family):
    paths = generate(tmp_path, 6, seed=5, families=[family])
    rows = await check_tasks([load_task(q) for q in paths], concurrency=3)
    assert {r.task_id: r.ok for r in rows} == {r.task_id: True for r in rows}
    assert all(r.null.passed == 0 for r in rows)
