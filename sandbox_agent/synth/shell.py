"""Families: git operations, small scripts, environment and processes."""

from __future__ import annotations

import random

from sandbox_agent.synth.common import NAMES, WORDS, SynthSpec, ident, para, pick

_GIT_ID = "-c user.name=setup -c user.email=setup@example.com"


def git_family(rng: random.Random) -> SynthSpec:
    repo = rng.choice(["repo", "service", "library", "tool"])
    n_commits = rng.randint(2, 5)
    files = [f"{ident(rng, 1)}.txt" for _ in range(n_commits)]
    branch = f"{rng.choice(['feature', 'fix', 'topic'])}/{ident(rng)}"
    notes = rng.choice(["NOTES.md", "CHANGES.md", "TODO.md"])
    content = para(rng, 8)
    msg = f"Add {notes.split('.')[0].lower()} about {rng.choice(WORDS)}"
    setup = [
        "set -e",
        f"mkdir {repo} && cd {repo}",
        "git init -q -b main .",
    ]
    for i, f in enumerate(files):
        setup.append(f"echo '{para(rng, 5)}' >> {f}")
        setup.append(f"git add {f} && git {_GIT_ID} commit -q -m 'commit {i + 1}: {f}'")
    setup.append(f"echo '{ident(rng)}' > untracked.tmp")
    instr = (
        f"`{repo}/` in the current directory is a git repository on branch `main`.\n"
        f"1. Create a branch `{branch}` from `main` and switch to it.\n"
        f"2. On that branch, add a file `{notes}` containing exactly the line `{content}` and commit it "
        f"with the message `{msg}` (only that file; `main` must stay unchanged).\n"
        f"3. Write the full hash of the repository's very first commit to `first_commit.txt` in the "
        f"current directory (not inside the repository)."
    )
    sol = f"""\
cd {repo}
git checkout -q -b {branch} main
echo '{content}' > {notes}
git add {notes}
git -c user.name=agent -c user.email=agent@example.com commit -q -m '{msg}'
git rev-list --max-parents=0 HEAD > ../first_commit.txt
cd ..
"""
    tests = f"""
def git(args):
    r = run("git -C {repo} " + args)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_branch_checked_out():
    assert git("rev-parse --abbrev-ref HEAD") == {branch!r}


def test_commit_on_branch():
    assert git("log -1 --format=%s {branch}") == {msg!r}
    assert git("show {branch}:{notes}") == {content!r}
    assert git("diff --name-only main {branch}").splitlines() == [{notes!r}]


def test_main_unchanged():
    assert git("rev-list --count main") == "{n_commits}"
    assert git("log -1 --format=%s main") == {f"commit {n_commits}: {files[-1]}"!r}


def test_first_commit_hash():
    assert read("first_commit.txt").strip() == git("rev-list --max-parents=0 main")
"""
    return SynthSpec("git", instr, sol, tests, setup="\n".join(setup) + "\n", difficulty="medium", tags=("git",))


def scripts_family(rng: random.Random) -> SynthSpec:
    name = f"{rng.choice(['calc', 'compute', 'arith', 'mathx'])}.sh"
    ops = dict(
        zip(
            pick(rng, ["add", "plus", "sum"], 1) + pick(rng, ["sub", "minus"], 1) + pick(rng, ["mul", "times"], 1),
            "+-*",
        )
    )
    bad_code = rng.choice([2, 3, 64])
    cases = [(rng.randint(-50, 99), rng.randint(-20, 99), op) for op in ops for _ in range(2)]
    expected = [(a, b, op, eval(f"{a} {sym} {b}")) for a, b, op in cases for o, sym in ops.items() if o == op]
    names = list(ops)
    instr = (
        f"Write an executable bash script `{name}` in the current directory. Usage: "
        f"`./{name} A OP B` where A and B are integers and OP is one of {', '.join(names)} "
        f"(meaning +, - and * in that order). It prints the integer result on stdout and exits 0.\n"
        f"If OP is anything else it prints `unknown operator: OP` to stderr, prints nothing on stdout, "
        f"and exits with status {bad_code}."
    )
    sol = f"""\
cat > {name} <<'EOF'
#!/bin/bash
a=$1; op=$2; b=$3
case "$op" in
  {names[0]}) echo $((a + b)) ;;
  {names[1]}) echo $((a - b)) ;;
  {names[2]}) echo $((a * b)) ;;
  *) echo "unknown operator: $op" >&2; exit {bad_code} ;;
esac
EOF
chmod +x {name}
"""
    tests = f"""
CASES = {expected!r}


def test_executable():
    assert os.access(WORK / {name!r}, os.X_OK)


def test_operations():
    for a, b, op, want in CASES:
        r = run(f"./{name} {{a}} {{op}} {{b}}")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(want), (a, op, b)


def test_unknown_operator():
    r = run("./{name} 3 pow 4")
    assert r.returncode == {bad_code}
    assert r.stdout == ""
    assert "unknown operator: pow" in r.stderr
"""
    return SynthSpec("scripts", instr, sol, tests, tags=("bash", "script"))


def env_family(rng: random.Random) -> SynthSpec:
    var = rng.choice(["APP_MODE", "DEPLOY_ENV", "STAGE", "RUN_LEVEL"])
    val = rng.choice(["production", "staging", "testing", "canary"])
    home_var = rng.choice(["PROJECT_HOME", "APP_HOME", "TOOL_ROOT"])
    tool = rng.choice(["greet", "hello", "welcome"])
    who = rng.choice(NAMES)
    default = rng.choice(["default", "unset", "none"])
    fail_code = rng.choice([3, 4, 7])
    secs = rng.choice([60, 90, 120])
    instr = (
        f"In the current directory:\n"
        f"1. Write `env.sh` so that `source env.sh` sets and exports `{var}={val}`, sets `{home_var}` to the "
        f"absolute path of this directory, and puts this directory's `bin/` first on `PATH`.\n"
        f"2. Create an executable `bin/{tool}` that prints `hello {who}`.\n"
        f"3. Write an executable `report.sh` that prints the value of `${var}`, or `{default}` when it is "
        f"unset or empty; when `{var}` is `fail` it prints nothing and exits with status {fail_code}.\n"
        f"4. Write an executable `start_bg.sh` that starts `sleep {secs}` in the background, writes its process "
        f"id to `bg.pid` in the current directory, and exits immediately (without waiting)."
    )
    sol = f"""\
d=$(pwd)
printf 'export {var}={val}\\nexport {home_var}=%s\\nexport PATH=%s/bin:$PATH\\n' "$d" "$d" > env.sh
mkdir -p bin
printf '#!/bin/bash\\necho "hello {who}"\\n' > bin/{tool}
chmod +x bin/{tool}
cat > report.sh <<'EOF'
#!/bin/bash
if [ "${var}" = fail ]; then exit {fail_code}; fi
echo "${{{var}:-{default}}}"
EOF
chmod +x report.sh
cat > start_bg.sh <<'EOF'
#!/bin/bash
sleep {secs} >/dev/null 2>&1 &
echo $! > bg.pid
EOF
chmod +x start_bg.sh
"""
    tests = f"""
def test_env_sh():
    r = run('source ./env.sh && echo "${var}|${home_var}" && command -v {tool}')
    assert r.returncode == 0, r.stderr
    first, where = r.stdout.strip().splitlines()
    assert first == "{val}|" + str(WORK)
    assert where == str(WORK / "bin" / "{tool}")


def test_tool():
    r = run("source ./env.sh && {tool}")
    assert r.stdout.strip() == "hello {who}"


def test_report_default_and_value():
    assert run("./report.sh").stdout.strip() == "{default}"
    assert run("./report.sh", env={{"{var}": ""}}).stdout.strip() == "{default}"
    assert run("./report.sh", env={{"{var}": "blue"}}).stdout.strip() == "blue"


def test_report_fail():
    r = run("./report.sh", env={{"{var}": "fail"}})
    assert r.returncode == {fail_code} and r.stdout == ""


def test_background_process():
    r = run("./start_bg.sh", timeout=10)
    assert r.returncode == 0
    pid = int(read("bg.pid").strip())
    try:
        import time

        for _ in range(100):  # the child may still be between fork and exec
            cmd = Path(f"/proc/{{pid}}/cmdline").read_bytes().split(b"\\0")
            if cmd[:2] == [b"sleep", b"{secs}"]:
                break
            time.sleep(0.05)
        assert cmd[:2] == [b"sleep", b"{secs}"]
    finally:
        run(f"kill {{pid}}")
"""
    return SynthSpec("env", instr, sol, tests, difficulty="medium", tags=("env", "process"))
