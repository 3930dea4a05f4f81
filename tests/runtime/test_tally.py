"""rdnattention.tally: the counts behind stats(), each reason reported once until a reset."""

from concurrent.futures import ThreadPoolExecutor

from rdnattention.tally import Tally


def test_each_reason_is_reported_once_until_a_reset():
    t = Tally()
    assert [t.add("a"), t.add("b", 3), t.add("a"), t.add("b")] == [True, True, False, False]
    t.hit()
    assert t.read() == (1, {"a": 2, "b": 4})
    assert t.read(reset=True) == (1, {"a": 2, "b": 4})
    assert t.read() == (0, {})
    assert t.add("a") is True  # reported again after the reset


def test_counts_from_many_threads_add_up_and_one_of_them_reports():
    t = Tally()

    def work(_):
        t.hit()
        return t.add("shared")

    with ThreadPoolExecutor(8) as pool:
        firsts = list(pool.map(work, range(4000)))
    assert sum(firsts) == 1
    assert t.read() == (4000, {"shared": 4000})
