"""Keys for NATS: one user per role with its own permissions, written by ``cluster up``, required by its servers.

    auth = make_server_auth(secrets_dir(run_dir), tls=True)   # nats-<role>.json (0600), the CA
    NatsServer.start(store, auth=auth)                        # users, permissions, route user, tls {}
    NatsTransport(config=NatsConfig(url, creds=creds_path(run_dir, Role.ACTOR)))

A credentials file (``--nats-creds FILE``) is either our JSON, ``{"user": ..., "password": ...,
"inbox_prefix": ..., "ca_file": ...}`` (only ``user`` and ``password`` are required; ``ca_file`` is the CA
that signed the server's TLS certificate), or a NATS ``.creds`` file (a user JWT and nkey seed, as ``nsc``
writes them) for an external NATS with decentralized auth. ``nats://user:password@host:4222`` works too.

Each role sees only what it needs (design §10); a role's replies come on its own inbox prefix
(``_INBOX.<role>.``), so no role can read another's replies (the learner's JetStream fetches among them):

    role     publish                                               subscribe
    actor    t1.traj.> t1.actor.> t1.metrics.actor.> t1.dead.>     t1.policy, its inbox
             t1.credit, stream info
    learner  t1.traj.> t1.policy t1.metrics.> t1.dead.>,           t1.credit t1.actor.>, its inbox
             T1_TRAJ/T1_DEAD stream API, T1_TRAJ consumer API,     (and replies to credit requests)
             acks
    eval     t1.metrics.eval t1.dead.>, stream info                t1.policy, its inbox
    reader   stream info                                           t1.> (tail, the dashboard), its inbox
    admin    everything (the operator's key: cluster up's stream   everything
             setup, bench.chaos)

Samplers do not use NATS. The routes of an embedded cluster have their own user. Passwords are 32 random
bytes (urlsafe base64); the server's config holds them too and is written 0600, like every file here.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from t1async.config import setting
from t1async.protocol.errors import ConfigError, ServerStartError


class Role(StrEnum):
    ADMIN = "admin"
    LEARNER = "learner"
    ACTOR = "actor"
    EVAL = "eval"
    READER = "reader"  # cluster tail, the dashboard


def inbox_prefix(role: Role) -> str:
    return f"_INBOX.{role}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False  # may answer requests it received (the learner's credits)


_STREAM_INFO = ("$JS.API.STREAM.INFO.T1_TRAJ", "$JS.API.STREAM.INFO.T1_DEAD")  # every transport checks its streams

PERMISSIONS: dict[Role, Permissions] = {
    Role.ACTOR: Permissions(
        ("t1.traj.>", "t1.actor.>", "t1.metrics.actor.>", "t1.dead.>", "t1.credit", *_STREAM_INFO),
        ("t1.policy", inbox_prefix(Role.ACTOR) + ".>"),
    ),
    Role.LEARNER: Permissions(
        (
            "t1.traj.>",  # the end of an abandoned episode
            "t1.policy",
            "t1.metrics.>",
            "t1.dead.>",
            "$JS.API.STREAM.*.T1_TRAJ",
            "$JS.API.STREAM.*.T1_DEAD",
            "$JS.API.CONSUMER.*.T1_TRAJ",
            "$JS.API.CONSUMER.*.T1_TRAJ.>",
            "$JS.API.CONSUMER.MSG.NEXT.T1_TRAJ.>",
            "$JS.ACK.T1_TRAJ.>",
        ),
        ("t1.credit", "t1.actor.>", inbox_prefix(Role.LEARNER) + ".>"),
        allow_responses=True,
    ),
    Role.EVAL: Permissions(
        ("t1.metrics.eval", "t1.dead.>", *_STREAM_INFO), ("t1.policy", inbox_prefix(Role.EVAL) + ".>")
    ),
    Role.READER: Permissions(_STREAM_INFO, ("t1.>", inbox_prefix(Role.READER) + ".>")),
    Role.ADMIN: Permissions((">",), (">",)),  # the operator's key: cluster up's stream setup, bench.chaos
}


@dataclass(frozen=True)
class NatsClientSettings:
    """The one declaration of ``--nats-creds``; every command that connects to NATS takes it with ``like``."""

    nats_creds: Path | None = setting(
        None,
        "NATS credentials: a JSON file cluster up writes (<run-dir>/secrets/nats-<role>.json) or a NATS .creds "
        "file; or give user:password in the URL",
        metavar="FILE",
    )


# ---------------------------------------------------------------------------------------------- client side


@dataclass(frozen=True)
class NatsCreds:
    user: str = ""
    password: str = ""
    inbox_prefix: str = "_INBOX"
    ca_file: Path | None = None  # the CA of a TLS server (cluster up --nats-tls)
    jwt_file: Path | None = None  # a NATS .creds file (user JWT and nkey seed)

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
        out: dict[str, Any] = {"inbox_prefix": self.inbox_prefix}
        if self.jwt_file is not None:
            out["user_credentials"] = str(self.jwt_file)
        elif self.user:
            out["user"], out["password"] = self.user, self.password
        if self.ca_file is not None:
            out["tls"] = ssl.create_default_context(cafile=str(self.ca_file))
        return out

    def to_json(self) -> str:
        d: dict[str, str] = {"user": self.user, "password": self.password, "inbox_prefix": self.inbox_prefix}
        if self.ca_file is not None:
            d["ca_file"] = str(self.ca_file)
        return json.dumps(d, indent=2) + "\n"


def load_creds(path: str | Path) -> NatsCreds:
    """The credentials in ``path`` (our JSON or a NATS .creds file); a one-line error for anything else."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(
            f"--nats-creds {p}: cannot read it ({exc.strerror}); `cluster up` writes <run-dir>/secrets/nats-<role>.json"
        ) from None
    if "BEGIN NATS USER JWT" in text:
        return NatsCreds(jwt_file=p)
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or not isinstance(d.get("user"), str) or not isinstance(d.get("password"), str):
            raise ValueError("needs string keys user and password")
        ca = d.get("ca_file")
        return NatsCreds(
            d["user"],
            d["password"],
            str(d.get("inbox_prefix") or "_INBOX"),
            (p.parent / ca) if isinstance(ca, str) and ca else None,
        )
    except ValueError as exc:
        raise ConfigError(
            f"--nats-creds {p}: not a credentials file ({exc}); write JSON "
            '{"user": "...", "password": "..."} or give a NATS .creds file'
        ) from None


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by its owner only (created 0600, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")  # mkstemp creates it 0600
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def redact(url: str) -> str:
    """``url`` (comma-separated servers) with any password replaced by ``***``, fit for logs and errors."""
    out = []
    for u in url.split(","):
        scheme, sep, rest = u.partition("://")
        info, at, hostport = rest.rpartition("@")
        if sep and at and ":" in info:
            u = f"{scheme}://{info.split(':', 1)[0]}:***@{hostport}"
        out.append(u)
    return ",".join(out)


# ---------------------------------------------------------------------------------------------- server side


def secrets_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "secrets"


def creds_path(run_dir: str | Path, role: Role) -> Path:
    return secrets_dir(run_dir) / f"nats-{role}.json"  # as make_server_auth(secrets_dir(run_dir)) names it


@dataclass(frozen=True)
class ServerAuth:
    """What a nats-server needs to require our users: each role's password, the routes', TLS files."""

    passwords: tuple[tuple[Role, str], ...]
    route_password: str = ""
    cert_file: Path | None = None
    key_file: Path | None = None
    route_user: str = "route"

    @property
    def tls(self) -> bool:
        return self.cert_file is not None

    def render(self) -> str:
        """The server config's ``authorization`` (and ``tls``) blocks."""
        users = []
        for role, pw in self.passwords:
            perm = PERMISSIONS[role]
            users.append(
                f"    {{\n      user: {_q(str(role))}\n      password: {_q(pw)}\n      permissions: {{\n"
                f"        publish: {{ allow: [{', '.join(_q(s) for s in perm.publish)}] }}\n"
                f"        subscribe: {{ allow: [{', '.join(_q(s) for s in perm.subscribe)}] }}\n"
                + ("        allow_responses: true\n" if perm.allow_responses else "")
                + "      }\n    }\n"
            )
        out = "authorization {\n  users: [\n" + "".join(users) + "  ]\n}\n"
        if self.cert_file is not None and self.key_file is not None:
            out += f"tls {{\n  cert_file: {_q(str(self.cert_file))}\n  key_file: {_q(str(self.key_file))}\n}}\n"
        return out

    def cluster_block(self) -> str:
        """The ``authorization`` inside ``cluster {}``: the user every route connects as."""
        return f"  authorization {{\n    user: {_q(self.route_user)}\n    password: {_q(self.route_password)}\n  }}\n"

    def route_userinfo(self) -> str:
        return f"{self.route_user}:{self.route_password}@"


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _password() -> str:
    return secrets.token_urlsafe(32)


def make_server_auth(d: str | Path, *, tls: bool = False, host: str = "127.0.0.1") -> ServerAuth:
    """Each role's credentials as ``<d>/nats-<role>.json`` (``cluster up``: d = <run-dir>/secrets; kept if there:
    a restarted run and the hosts ``d`` was copied to go on using them), the route password, and with ``tls`` a CA
    and a server certificate for ``host`` (``ca.pem``, ``server.pem``, ``server.key``)."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    ca = cert = key = None
    if tls:
        ca, cert, key = make_tls(d, host)
    passwords = []
    for role in Role:
        path = d / f"nats-{role}.json"
        old = load_creds(path) if path.is_file() else None
        pw = old.password if old is not None and old.user == role else _password()
        want = NatsCreds(str(role), pw, inbox_prefix(role), ca.resolve() if ca else None)
        if old != want:
            write_private(path, want.to_json())
        passwords.append((role, pw))
    route = d / "nats-route.password"
    if not route.is_file():
        write_private(route, _password() + "\n")
    return ServerAuth(tuple(passwords), route.read_text().strip(), cert, key)


def make_tls(d: Path, host: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for ``host`` (and 127.0.0.1, localhost), made with the ``openssl`` CLI
    once and kept; returns (ca.pem, server.pem, server.key)."""
    ca, ca_key, cert, key = d / "ca.pem", d / "ca.key", d / "server.pem", d / "server.key"
    san = f"{host}.san"
    if ca.is_file() and cert.is_file() and key.is_file() and (d / san).is_file():
        return ca, cert, key
    ip = host.replace(".", "").isdigit() or ":" in host
    names = sorted({"IP:127.0.0.1", "DNS:localhost", f"{'IP' if ip else 'DNS'}:{host}"})
    ext = d / "server.ext"
    ext.write_text(
        f"subjectAltName={','.join(names)}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    cmds = [
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "3650", "-subj", "/CN=t1async NATS CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", *ec, "-keyout", key, "-out", d / "server.csr", "-subj", f"/CN={host}"],
        ["x509", "-req", "-in", d / "server.csr", "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "825", "-extfile", ext],
    ]  # fmt: skip
    old = os.umask(0o077)
    try:
        for c in cmds:
            try:
                subprocess.run(["openssl", *map(str, c)], check=True, capture_output=True, text=True)
            except FileNotFoundError:
                raise ServerStartError(
                    "--nats-tls needs the openssl command: install it (apt install openssl)"
                ) from None
            except subprocess.CalledProcessError as exc:
                raise ServerStartError(
                    f"openssl {c[0]} failed making the NATS TLS files: {exc.stderr.strip()}"
                ) from None
    finally:
        os.umask(old)
    (d / san).write_text("")
    return ca, cert, key
