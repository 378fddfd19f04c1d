"""The one refusal table both protocols keep: bounded in number and time, an entry taken
once, cleared by a success; and the summary a waiting room's timeout names."""

from prefill_worker.transfer.push.refusals import ExpiringTable, summary


def test_a_refusal_is_kept_for_its_time_and_cleared_by_a_registration() -> None:
    names: ExpiringTable[str, str] = ExpiringTable(keep_s=10.0, max_items=8)
    names.add("d0", "dtype bfloat16, not float32", now=0.0)
    assert names.get("d0", now=9.9) == "dtype bfloat16, not float32"
    assert names.get("d0", now=10.0) is None
    assert names.get("d1", now=1.0) is None
    names.clear("d0")
    assert names.get("d0", now=1.0) is None and summary(names, 1.0) is None


def test_the_summary_names_the_newest_first_and_only_the_newest_few() -> None:
    names: ExpiringTable[str, str] = ExpiringTable(keep_s=10.0, max_items=2)
    for i, name in enumerate(["a", "b", "c"]):
        names.add(name, f"why {name}", now=float(i))
    assert names.get("a", now=2.0) is None  # pushed out by the bound
    assert summary(names, 2.0) == "registrations refused lately: 'c' (why c); 'b' (why b)"
    assert summary(names, 11.5) == "registrations refused lately: 'c' (why c)"  # b expired
    names.add("x" * 100, "long", now=3.0)
    assert f"'{'x' * 64}' (long)" in (summary(names, 3.0) or "")


def test_a_refused_room_is_taken_once_within_its_time() -> None:
    rooms: ExpiringTable[int, str] = ExpiringTable(keep_s=5.0, max_items=1024)
    rooms.add(7, "registration refused: page size", now=0.0)
    rooms.add(8, "registration refused: page size", now=0.0)
    assert rooms.take(7, now=4.9) == "registration refused: page size"
    assert rooms.take(7, now=4.9) is None
    assert rooms.take(8, now=5.0) is None  # past keep_s


def test_what_an_unregistered_sender_leaves_is_bounded() -> None:
    rooms: ExpiringTable[int, str] = ExpiringTable(keep_s=5.0, max_items=3)
    for room in range(10):
        rooms.add(room, "decode not registered", now=0.0)
    assert len(rooms) == 3
    assert rooms.take(0, now=1.0) is None and rooms.take(9, now=1.0) is not None
