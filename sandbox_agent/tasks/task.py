"""Terminal-Bench tasks: the ``Task`` record and loaders for both on-disk formats.

TB1 (terminal-bench 0.x) task directory::

    task.yaml            instruction (or descriptions[0].description), max_agent_timeout_sec,
                         max_test_timeout_sec, parser_name, difficulty, category, tags, ...
    solution.sh          the oracle solution
    run-tests.sh         the harness's test entry point (usually installs pytest from the network)
    tests/test_outputs.py
    Dockerfile           optional: a task-specific image (we then need a container backend)

TB2 / Harbor task directory::

    task.toml            [metadata] ..., [verifier] timeout_sec, [agent] timeout_sec,
                         [environment] docker_image, ...
    instruction.md
    tests/test.sh        (+ tests/test_*.py)
    solution/solve.sh
    environment/Dockerfile   optional: a task-specific image

Our extension, used by the synthetic corpus (``sandbox_agent.synth``) in both formats: every file under
``environment/`` except ``Dockerfile`` and ``docker-compose.yaml`` is copied into the agent's work dir
before the episode starts (``Task.environment_dir``; see ``populate_workdir``), and an optional
``setup.sh`` at the task root runs inside the sandbox (cwd = the work dir) before the agent's first turn
(``Task.setup_script``): it stands in for the image build steps a Dockerfile would do.

Loading never needs a container backend; *running* a task that names its own image does, and raises
``TaskNeedsImageError`` from ``require_backend`` when the backend cannot provide it.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from t1async.protocol.errors import ConfigError, T1Error

TaskFormat = Literal["tb1", "tb2"]
Split = Literal["train", "eval", "test"]

DEFAULT_AGENT_TIMEOUT_S = 900.0
DEFAULT_TEST_TIMEOUT_S = 180.0
EVAL_PERCENT = 10  # deterministic split: this share of content keys (by hash) is held out for eval...
TEST_PERCENT = 10  # ...and this share for test (never looked at while tuning)
SPLIT_VERSION = "content-v1"  # bump when split_for or a family's content key changes (caches key on it)
_NOT_COPIED = frozenset({"Dockerfile", "docker-compose.yaml", "docker-compose.yml"})


class TaskFormatError(ConfigError):
    """A task directory is malformed: names the file and field and says what was expected."""


class TaskNeedsImageError(T1Error):
    """The task needs its own container image, and the chosen backend cannot provide one."""

    def __init__(self, task: Task, backend: str, why: str | None = None) -> None:
        super().__init__(
            f"task {task.id!r} needs image {task.docker_image!r}; no container backend is available "
            f"(backend {backend!r} runs only tasks with the default environment"
            + (f"; bwrap cannot reproduce {why}" if why else "")
            + "). Pick a task without a Dockerfile/docker_image, or run it with a container backend "
            "(--backend container; install podman: apt-get install -y podman runc)."
        )
        self.task_id = task.id
        self.image = task.docker_image


@dataclass(frozen=True)
class Task:
    id: str
    path: Path
    format: TaskFormat
    instruction: str
    agent_timeout_s: float
    test_timeout_s: float
    tests_dir: Path
    test_files: tuple[str, ...]  # pytest files under tests_dir (relative names), run directly by the verifier
    test_script: Path | None  # run-tests.sh (tb1) or tests/test.sh (tb2): the harness's entry point
    solution: Path | None  # solution.sh (tb1) or solution/solve.sh (tb2)
    environment_dir: Path | None  # files copied into the work dir before the episode
    setup_script: Path | None  # setup.sh (our extension): run in the sandbox, cwd = work dir, before the agent
    docker_image: str | None  # None: the default environment (our bwrap sandbox can run it)
    split: Split
    family: str
    parser: str = "pytest"
    difficulty: str = ""
    tags: tuple[str, ...] = ()
    content_key: str = ""  # what makes two tasks the same task (the split hashes it); the id when not given
    extra: dict = field(default_factory=dict, compare=False, repr=False)


def split_for(content_key: str, eval_percent: int = EVAL_PERCENT, test_percent: int = TEST_PERCENT) -> Split:
    """Deterministic train/eval/test split by a hash of the task's content key (stable across machines and
    runs): every task with the same key lands in the same split, so eval and test hold out whole keys. A task
    without a key (a Terminal-Bench task) is split by its id."""
    h = int.from_bytes(hashlib.sha256(content_key.encode()).digest()[:8], "big") % 100
    return "eval" if h < eval_percent else "test" if h < eval_percent + test_percent else "train"


def detect_format(path: Path) -> TaskFormat:
    if (path / "task.toml").is_file():
        return "tb2"
    if (path / "task.yaml").is_file():
        return "tb1"
    raise TaskFormatError(
        f"{path} is not a task directory: expected task.yaml (Terminal-Bench 1) or task.toml "
        f"(Terminal-Bench 2 / Harbor) in it"
    )


def load_task(path: str | Path) -> Task:
    """Load one task directory (format detected from task.yaml / task.toml)."""
    p = Path(path)
    if not p.is_dir():
        raise TaskFormatError(f"task directory {p} does not exist (or is not a directory)")
    p = p.resolve()
    fmt = detect_format(p)
    return _load_tb2(p) if fmt == "tb2" else _load_tb1(p)


def iter_task_dirs(root: str | Path) -> Iterator[Path]:
    """Task directories at or below ``root`` (a task dir itself, or a tree of them), sorted."""
    r = Path(root)
    if not r.is_dir():
        raise TaskFormatError(f"task corpus {r} does not exist (or is not a directory)")
    if (r / "task.yaml").is_file() or (r / "task.toml").is_file():
        yield r
        return
    found = sorted({q.parent for pat in ("task.yaml", "task.toml") for q in r.rglob(pat)})
    yield from found


def load_tasks(root: str | Path) -> list[Task]:
    return [load_task(d) for d in iter_task_dirs(root)]


# ---------------------------------------------------------------------------------------------- TB1


def _yaml_load(file: Path) -> Any:
    try:
        import yaml  # pyyaml: a dependency of huggingface_hub today; asked to be listed in pyproject
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(f"reading {file} needs PyYAML (import yaml failed); install it: pip install pyyaml") from exc
    try:
        return yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise TaskFormatError(f"{file}: invalid YAML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise TaskFormatError(f"{file}: not UTF-8 text: {exc}") from exc


def _load_tb1(p: Path) -> Task:
    f = p / "task.yaml"
    doc = _yaml_load(f)
    if not isinstance(doc, dict):
        raise TaskFormatError(f"{f}: expected a mapping at top level, got {type(doc).__name__}")
    instruction = doc.get("instruction")
    if instruction is None and isinstance(doc.get("descriptions"), list) and doc["descriptions"]:
        first = doc["descriptions"][0]  # early TB1 tasks: descriptions: [{key: base, description: ...}]
        instruction = first.get("description") if isinstance(first, dict) else None
    instruction = _req_str(instruction, f, "instruction")
    tests_dir = p / "tests"
    image = _opt_str(doc.get("docker_image", doc.get("image")), f, "docker_image")
    if (p / "Dockerfile").is_file():  # as for TB2: a shipped Dockerfile is built, a named image only recorded
        image = f"dockerfile:{p / 'Dockerfile'}"
    env = p / "environment"
    tid = _opt_str(doc.get("id"), f, "id") or p.name
    key = _opt_str(doc.get("content_key"), f, "content_key") or tid
    return Task(
        id=tid,
        path=p,
        format="tb1",
        instruction=instruction,
        agent_timeout_s=_num(doc.get("max_agent_timeout_sec"), f, "max_agent_timeout_sec", DEFAULT_AGENT_TIMEOUT_S),
        test_timeout_s=_num(doc.get("max_test_timeout_sec"), f, "max_test_timeout_sec", DEFAULT_TEST_TIMEOUT_S),
        tests_dir=tests_dir,
        test_files=_test_files(tests_dir),
        test_script=(p / "run-tests.sh") if (p / "run-tests.sh").is_file() else None,
        solution=(p / "solution.sh") if (p / "solution.sh").is_file() else None,
        environment_dir=env if env.is_dir() else None,
        setup_script=(p / "setup.sh") if (p / "setup.sh").is_file() else None,
        docker_image=image,
        split=_split(doc.get("split"), f, key),
        family=_opt_str(doc.get("family"), f, "family") or _opt_str(doc.get("category"), f, "category") or "",
        parser=_opt_str(doc.get("parser_name"), f, "parser_name") or "pytest",
        difficulty=_opt_str(doc.get("difficulty"), f, "difficulty") or "",
        tags=_str_tuple(doc.get("tags"), f, "tags"),
        content_key=key,
        extra={k: v for k, v in doc.items() if k not in _TB1_KNOWN},
    )


_TB1_KNOWN = frozenset(
    "id instruction descriptions max_agent_timeout_sec max_test_timeout_sec parser_name difficulty "
    "category tags family split content_key docker_image image".split()
)


# ---------------------------------------------------------------------------------------------- TB2


def _load_tb2(p: Path) -> Task:
    f = p / "task.toml"
    try:
        doc = tomllib.loads(f.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{f}: invalid TOML: {exc}") from exc
    meta = _table(doc, "metadata", f)
    verifier = _table(doc, "verifier", f)
    agent = _table(doc, "agent", f)
    envt = _table(doc, "environment", f)
    instr_file = p / "instruction.md"
    if not instr_file.is_file():
        raise TaskFormatError(f"{p}: TB2 task has task.toml but no instruction.md next to it")
    instruction = instr_file.read_text(encoding="utf-8")
    if not instruction.strip():
        raise TaskFormatError(f"{instr_file} is empty: a task needs an instruction")
    tests_dir = p / "tests"
    env = p / "environment"
    # Published TB2 tasks name a prebuilt image (on a registry unreachable here) *and* ship its Dockerfile:
    # the Dockerfile is built then, and the name kept in extra["prebuilt_image"].
    prebuilt = _opt_str(envt.get("docker_image"), f, "environment.docker_image")
    image = f"dockerfile:{env / 'Dockerfile'}" if (env / "Dockerfile").is_file() else prebuilt
    solve = p / "solution" / "solve.sh"
    tid = _opt_str(meta.get("id", doc.get("id")), f, "metadata.id") or p.name
    key = _opt_str(meta.get("content_key"), f, "metadata.content_key") or tid
    return Task(
        id=tid,
        path=p,
        format="tb2",
        instruction=instruction,
        agent_timeout_s=_num(agent.get("timeout_sec"), f, "agent.timeout_sec", DEFAULT_AGENT_TIMEOUT_S),
        test_timeout_s=_num(verifier.get("timeout_sec"), f, "verifier.timeout_sec", DEFAULT_TEST_TIMEOUT_S),
        tests_dir=tests_dir,
        test_files=_test_files(tests_dir),
        test_script=(tests_dir / "test.sh") if (tests_dir / "test.sh").is_file() else None,
        solution=solve if solve.is_file() else None,
        environment_dir=env if env.is_dir() else None,
        setup_script=(p / "setup.sh") if (p / "setup.sh").is_file() else None,
        docker_image=image,
        split=_split(meta.get("split"), f, key),
        family=_opt_str(meta.get("family"), f, "metadata.family")
        or _opt_str(meta.get("category"), f, "metadata.category")
        or "",
        parser="pytest",
        difficulty=_opt_str(meta.get("difficulty"), f, "metadata.difficulty") or "",
        tags=_str_tuple(meta.get("tags"), f, "metadata.tags"),
        content_key=key,
        extra={
            **{k: v for k, v in doc.items() if k not in ("metadata", "verifier", "agent", "environment")},
            **({"prebuilt_image": prebuilt} if prebuilt and image != prebuilt else {}),
            **({"resources": res} if (res := _resources(envt, f)) else {}),
        },
    )


# ------------------------------------------------------------------------------------------ helpers


_SIZE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _resources(envt: dict, f: Path) -> dict[str, float]:
    """A TB2 task's declared container resources: ``cpus``, ``memory_bytes`` (from ``memory_mb`` or
    ``memory = "2G"``), ``storage_bytes`` (``storage_mb`` / ``storage``); only those it names."""
    out: dict[str, float] = {}
    if envt.get("cpus") is not None:
        out["cpus"] = _num(envt["cpus"], f, "environment.cpus", 1.0)
    for key in ("memory", "storage"):
        mb, text = envt.get(f"{key}_mb"), envt.get(key)
        if mb is not None:
            out[f"{key}_bytes"] = _num(mb, f, f"environment.{key}_mb", 1.0) * (1 << 20)
        elif text is not None:
            m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
            if m is None:
                raise TaskFormatError(
                    f'{f}: field \'environment.{key}\' must be a size like "2G" or "512M", got {text!r}'
                )
            out[f"{key}_bytes"] = float(m.group(1)) * _SIZE[m.group(2).upper()]
    return out


def _table(doc: dict, key: str, f: Path) -> dict:
    v = doc.get(key, {})
    if not isinstance(v, dict):
        raise TaskFormatError(f"{f}: [{key}] must be a table, got {type(v).__name__}")
    return v


def _req_str(v: Any, f: Path, name: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise TaskFormatError(f"{f}: field {name!r} must be a non-empty string, got {v!r:.80}")
    return v


def _opt_str(v: Any, f: Path, name: str) -> str | None:
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    if not isinstance(v, str):
        raise TaskFormatError(f"{f}: field {name!r} must be a string, got {type(v).__name__} {v!r:.80}")
    return v


def _num(v: Any, f: Path, name: str, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise TaskFormatError(f"{f}: field {name!r} must be a positive number of seconds, got {v!r}")
    return float(v)


def _str_tuple(v: Any, f: Path, name: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TaskFormatError(f"{f}: field {name!r} must be a list of strings, got {v!r:.80}")
    return tuple(v)


def _split(v: Any, f: Path, content_key: str) -> Split:
    if v is None:
        return split_for(content_key)
    if v not in ("train", "eval", "test"):
        raise TaskFormatError(f"{f}: field 'split' must be 'train', 'eval' or 'test', got {v!r}")
    return v


def _test_files(tests_dir: Path) -> tuple[str, ...]:
    if not tests_dir.is_dir():
        return ()
    # pytest's default python_files: test_*.py and *_test.py (Aider polyglot's tests are <exercise>_test.py)
    names = {q.name for pat in ("test_*.py", "*_test.py") for q in tests_dir.glob(pat) if q.is_file()}
    return tuple(sorted(names))


def populate_workdir(task: Task, workdir: Path) -> None:
    """Copy the task's ``environment/`` files (not its Dockerfile) into ``workdir`` (which must exist).

    A task with a Dockerfile gets exactly what its Dockerfile COPYs instead (the backend's ``prepare``):
    ``environment/`` is then its build context, not a list of inputs."""
    if task.environment_dir is None or (task.docker_image or "").startswith("dockerfile:"):
        return
    for src in sorted(task.environment_dir.iterdir()):
        if src.name in _NOT_COPIED:
            continue
        dst = workdir / src.name
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
