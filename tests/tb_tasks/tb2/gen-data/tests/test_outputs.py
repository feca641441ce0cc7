from pathlib import Path

NUMBERS = [int(x) for x in Path("/data/numbers.txt").read_text().split()]


def test_sum():
    assert int(Path("/app/sum.txt").read_text()) == sum(NUMBERS)


def test_max():
    assert int(Path("/app/max.txt").read_text()) == max(NUMBERS)
