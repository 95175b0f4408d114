"""The device tests measure in a child process (``edgevlm_testkit.child``), so a driver that
crashes freeing a model after the measurement (Mesa 22.3's lavapipe did in CI: SIGABRT under
``llama_free``) loses nothing measured and does not end the suite — while a child that fails
before measuring, or fails in Python after it, still fails the test. A child that dies of a signal
before measuring measures once more. Checked here with real children that do exactly those
things."""

from __future__ import annotations

import os

import pytest

from edgevlm_testkit.child import DriverCrash, measured_in_child, run_in_child


def emits_then_aborts(value: int, emit) -> None:
    emit({"value": value, "rows": [1, 2]})
    os.abort()  # what the driver's worker thread did while the model was freed


def emits_then_raises(emit) -> None:
    emit({"value": 1})
    raise RuntimeError("closing went wrong in Python")


def raises_before_emitting(emit) -> None:
    raise ValueError("no such model file")


def emits_and_returns(emit) -> None:
    emit([{"a": 1}])


def aborts_once_before_emitting(marker: str, emit) -> None:
    """Dies of SIGABRT the first time (no ``marker`` yet), measures the second."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    emit({"second": True})


def always_aborts_before_emitting(emit) -> None:
    os.abort()


HERE = __name__


def test_a_child_that_measured_and_then_crashed_keeps_its_measurement_with_a_warning():
    got = run_in_child(f"{HERE}:emits_then_aborts", value=7)
    assert got.result == {"value": 7, "rows": [1, 2]}
    assert got.died_after == "SIGABRT"
    with pytest.warns(DriverCrash, match="SIGABRT freeing the model"):
        assert measured_in_child(f"{HERE}:emits_then_aborts", value=3)["value"] == 3


def test_a_child_that_exits_cleanly_gives_its_measurement_without_a_warning(recwarn):
    assert measured_in_child(f"{HERE}:emits_and_returns") == [{"a": 1}]
    assert not recwarn.list


def test_a_child_that_crashed_before_measuring_measures_again_once(tmp_path):
    with pytest.warns(DriverCrash, match="SIGABRT before measuring; measuring again"):
        assert measured_in_child(f"{HERE}:aborts_once_before_emitting", marker=str(tmp_path / "m")) == {"second": True}
    with (
        pytest.warns(DriverCrash, match="measuring again"),
        pytest.raises(AssertionError, match="measured nothing \\(SIGABRT\\)"),
    ):
        measured_in_child(f"{HERE}:always_aborts_before_emitting")


def test_a_child_that_fails_in_python_fails_the_test_with_its_traceback():
    with pytest.raises(AssertionError, match="(?s)measured nothing.*no such model file"):
        measured_in_child(f"{HERE}:raises_before_emitting")
    with pytest.raises(AssertionError, match="(?s)failed after measuring \\(exit 1\\).*closing went wrong"):
        measured_in_child(f"{HERE}:emits_then_raises")
