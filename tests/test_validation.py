import pytest

from gradsync.validation import check_choice, check_float, check_int


def test_check_int_range_and_message():
    assert check_int("ratio", 3, 1, 32) == 3
    with pytest.raises(ValueError, match=r"ratio must be an integer in \[1, 32\], got 0"):
        check_int("ratio", 0, 1, 32)
    with pytest.raises(ValueError, match="ratio"):
        check_int("ratio", 2.5, 1, 32)
    with pytest.raises(ValueError, match="ratio"):
        check_int("ratio", True, 1, 32)


def test_check_float_and_choice():
    assert check_float("lr", 0.1, 0.0, None, low_inclusive=False) == 0.1
    with pytest.raises(ValueError, match=r"lr must be in \(0.0, inf\]"):
        check_float("lr", 0.0, 0.0, None, low_inclusive=False)
    with pytest.raises(ValueError, match="lr"):
        check_float("lr", float("nan"), 0.0, None)
    with pytest.raises(ValueError, match="algorithm must be one of a, b"):
        check_choice("algorithm", "c", ["a", "b"])
