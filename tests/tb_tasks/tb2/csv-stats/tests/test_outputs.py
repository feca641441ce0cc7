import json
from pathlib import Path


def test_totals_file():
    assert Path("/app/totals.json").exists()


def test_region_sums():
    d = json.loads(Path("/app/totals.json").read_text())
    assert (d["north"], d["south"], d["east"]) == (150, 80, 50)


def test_currency():
    assert json.loads(Path("/app/totals.json").read_text())["currency"] == "EUR"
