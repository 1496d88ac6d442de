"""Helpers of the lite pipeline tests. The chain pipeline's reference lives in
the test kit (:mod:`trace_testing.lite_reference`), shared with the ``lite-kill``
chaos benchmark; the pipeline tests keep importing it from here."""

from trace_testing.lite_reference import (
    EXAMPLE,
    check_outputs,
    expected_alerts,
    small_dag,
    stored_alerts,
)

__all__ = ["EXAMPLE", "check_outputs", "expected_alerts", "small_dag", "stored_alerts"]
