from pathlib import Path


def test_total_file_exists():
    assert Path("/app/total.txt").exists()


def test_total_is_right():
    assert Path("/app/total.txt").read_text().strip() == "6"
