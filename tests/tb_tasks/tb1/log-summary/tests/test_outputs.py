from pathlib import Path

REPORT = Path("/app/report.txt")


def test_report_exists():
    assert REPORT.exists()


def test_status_counts():
    lines = REPORT.read_text().splitlines()
    assert lines[:3] == ["200 3", "404 1", "500 1"]


def test_items_total():
    assert REPORT.read_text().splitlines()[-1] == "items 15"
