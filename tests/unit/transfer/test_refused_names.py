"""RefusedNames: refusals by agent name, bounded in number and time, cleared by a success."""

from prefill_worker.transfer.refused_names import RefusedNames


def test_a_refusal_is_kept_for_its_time_and_cleared_by_a_registration() -> None:
    names = RefusedNames(keep_s=10.0)
    names.add("d0", "dtype bfloat16, not float32", now=0.0)
    assert names.reason_for("d0", now=9.9) == "dtype bfloat16, not float32"
    assert names.reason_for("d0", now=10.0) is None
    assert names.reason_for("d1", now=1.0) is None
    names.clear("d0")
    assert names.reason_for("d0", now=1.0) is None and names.summary(1.0) is None


def test_the_summary_names_the_newest_first_and_only_the_newest_few() -> None:
    names = RefusedNames(keep_s=10.0, max_names=2)
    for i, name in enumerate(["a", "b", "c"]):
        names.add(name, f"why {name}", now=float(i))
    assert names.reason_for("a", now=2.0) is None  # pushed out by the bound
    assert names.summary(2.0) == "registrations refused lately: 'c' (why c); 'b' (why b)"
    assert names.summary(11.5) == "registrations refused lately: 'c' (why c)"  # b expired
    names.add("x" * 100, "long", now=3.0)
    assert f"'{'x' * 64}' (long)" in (names.summary(3.0) or "")
