"""What the learner must remember across a restart besides weights: which turns each version trained.

Saved as ``learner_state_v<version>.json`` beside the checkpoints (written to a temp file and renamed),
so a resumed learner pairs the newest checkpoint with exactly the turns trained into it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_NAME = re.compile(r"^learner_state_v(\d{6,})\.json$")


@dataclass(frozen=True)
class LearnerState:
    policy_version: int = 0
    step: int = 0
    trained: dict[str, frozenset[int]] = field(default_factory=dict)  # episode -> turns trained
    turns_trained: int = 0
    session_turns: int = 0  # turns trained by this process (for turns/s)
    session_tokens: int = 0

    def was_trained(self, episode: str, turn: int) -> bool:
        t = self.trained.get(episode)
        return t is not None and turn in t

    def after_step(self, policy_version: int, step: int, turns: list[tuple[str, int]], tokens: int = 0) -> LearnerState:
        trained = dict(self.trained)
        for ep, t in turns:
            trained[ep] = trained.get(ep, frozenset()) | {t}
        return LearnerState(
            policy_version,
            step,
            trained,
            self.turns_trained + len(turns),
            self.session_turns + len(turns),
            self.session_tokens + tokens,
        )

    def save(self, root: Path, keep: int = 3) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"learner_state_v{self.policy_version:06d}.json"
        tmp = path.with_suffix(".tmp")
        body = {
            "policy_version": self.policy_version,
            "step": self.step,
            "turns_trained": self.turns_trained,
            "trained": {ep: sorted(t) for ep, t in self.trained.items()},
        }
        tmp.write_text(json.dumps(body))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        olds = sorted(p for p in root.iterdir() if _NAME.match(p.name))
        for old in olds[:-keep] if keep > 0 else []:
            old.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, root: Path, policy_version: int | None = None) -> LearnerState:
        """The state saved with checkpoint ``policy_version`` (None: the newest), or a fresh state."""
        if not root.is_dir():
            return cls()
        found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))
        if policy_version is not None:
            found = [(v, p) for v, p in found if v == policy_version]
        if not found:
            return cls(policy_version=policy_version or 0)
        v, p = found[-1]
        body = json.loads(p.read_text())
        trained = {ep: frozenset(int(t) for t in ts) for ep, ts in body.get("trained", {}).items()}
        return cls(int(body["policy_version"]), int(body["step"]), trained, int(body.get("turns_trained", 0)))
