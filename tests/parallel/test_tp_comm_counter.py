"""The communication counter: exact records inside `capture`, running totals per kind."""

from megamamba.parallel.comm_counter import CommCounter, CommRecord, CommTotals


def test_capture_lists_every_record_in_order():
    counter = CommCounter()
    with counter.capture() as records:
        counter.record("all_gather", 96, 2)
        counter.record("reduce_scatter", 96, 2)
    counter.record("all_reduce", 8, 2)
    assert records == [CommRecord("all_gather", 96, 2), CommRecord("reduce_scatter", 96, 2)]


def test_nested_captures_both_see_inner_records():
    counter = CommCounter()
    with counter.capture() as outer:
        counter.record("all_reduce", 4, 4)
        with counter.capture() as inner:
            counter.record("all_reduce", 8, 4)
    assert inner == [CommRecord("all_reduce", 8, 4)]
    assert outer == [CommRecord("all_reduce", 4, 4), CommRecord("all_reduce", 8, 4)]


def test_snapshot_totals_calls_and_bytes_per_kind_until_reset():
    counter = CommCounter()
    counter.record("all_reduce", 4, 2)
    counter.record("all_reduce", 6, 2)
    counter.record("all_gather", 10, 2)
    assert counter.snapshot() == {"all_reduce": CommTotals(2, 10), "all_gather": CommTotals(1, 10)}
    counter.reset()
    assert counter.snapshot() == {}
