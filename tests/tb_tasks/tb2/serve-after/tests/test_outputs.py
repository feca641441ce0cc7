import os
import subprocess
import urllib.request

# the image's interpreter, not the test venv's (python:3.x-slim has it in /usr/local/bin, Debian in /usr/bin)
SYSTEM_PYTHON = next(p for p in ("/usr/local/bin/python3", "/usr/bin/python3") if os.path.exists(p))


def test_humanize_was_installed_for_the_system_python():
    r = subprocess.run([SYSTEM_PYTHON, "-c", "import humanize; print(humanize.intcomma(1000))"],
                       capture_output=True, text=True)
    assert r.stdout.strip() == "1,000", r.stderr


def test_the_server_the_agent_left_running_serves_the_config():
    body = urllib.request.urlopen("http://127.0.0.1:8765/config.txt", timeout=5).read().decode()
    assert body == "8,765,000"
