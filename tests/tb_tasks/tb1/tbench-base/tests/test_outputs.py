import tomllib
from pathlib import Path

import six  # installed by run-tests.sh, not in the image


def test_report_is_in_the_images_workdir():
    assert Path("/app/report.txt").read_text().strip() == "ready"


def test_status_toml_was_written_with_tomli_w():
    assert tomllib.loads(Path("/app/status.toml").read_text()) == {"status": "ready"}


def test_the_scripts_own_pins_are_installed():
    assert six.__version__ == "1.16.0"
