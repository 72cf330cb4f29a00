"""Sessions: person overrides, the JSON-lines log, resuming from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moereplay.bisect import (
    BisectError,
    BisectLogError,
    Decider,
    Dimension,
    FirstBadSearch,
    MutationSearch,
    Observation,
    Outcome,
    PackSearch,
    Session,
    ShapeSearch,
    Signature,
    default_log_path,
    read_log,
)
from moereplay.bisect.probes import ItemProbe, ShapeProbe, SubsetProbe
from moereplay.errors import InvalidMutationError, MoereplayError, ReplayError

TARGET = Signature("corrupt", frozenset({"wrong_routing_weight"}), frozenset({3}))


def stream_predicate(first_bad: int, calls: list[int] | None = None):
    def predicate(probe: ItemProbe[int]) -> Observation:
        if calls is not None:
            calls.append(probe.index)
        return Observation.bad(TARGET) if probe.index >= first_bad else Observation.good()

    return predicate


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_records_every_step_and_the_summary(tmp_path: Path) -> None:
    log = default_log_path(
        tmp_path / "run.mrcap", "calls", environ={"MOEREPLAY_STATE_DIR": str(tmp_path / "s")}
    )
    assert log.parent == tmp_path / "s" / "bisect"
    assert log.name.startswith("run.mrcap-") and log.name.endswith(".bisect-calls.jsonl")
    # another capture of the same name elsewhere gets a log of its own; unset, the state is ./moereplay-captures
    assert default_log_path(tmp_path / "other" / "run.mrcap", "calls", environ={}) != log.with_name(log.name)
    assert default_log_path(tmp_path / "run.mrcap", "calls", environ={}).parent == Path(
        "moereplay-captures/bisect"
    )
    session = Session(
        FirstBadSearch(list(range(50))), stream_predicate(17), log_path=log, capture="run.mrcap"
    )
    summary = session.run_to_end()
    assert summary.done and summary.result is not None and summary.result.first_bad == 17
    assert summary.auto_steps == summary.steps == len(session.steps)
    lines = records(log)
    assert lines[0]["record"] == "session"
    assert lines[0]["strategy"] == "calls"
    assert lines[0]["capture"] == "run.mrcap"
    assert [line["record"] for line in lines[1:-1]] == ["step"] * summary.steps
    assert lines[1]["probe"] == {"key": 49, "label": "49"}
    assert lines[1]["decided_by"] == "auto"
    assert lines[1]["observation"]["signature"]["verdict"] == "corrupt"
    assert lines[-1]["record"] == "summary"
    assert lines[-1]["summary"]["result"]["first_bad"] == 17
    assert summary.to_json()["status"] == "found"


def test_person_overrides_good_bad_skip(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    calls: list[int] = []
    session = Session(FirstBadSearch(list(range(16))), stream_predicate(9, calls), log_path=log)
    session.step()  # 15: bad, adopts the target
    assert session.current is not None and session.current.index == 7
    auto = session.evaluate()
    assert auto.outcome is Outcome.GOOD
    assert session.evaluate() is auto  # not run twice
    # The person disagrees: item 7 is bad.
    step = session.decide(Outcome.BAD, "saw the wrong weight by eye")
    assert (step.decided_by, step.auto_observation) == (Decider.PERSON, auto)
    assert step.observation.signature == TARGET  # a person's "bad" means the target bug
    assert session.current is not None and session.current.index == 3
    session.decide(Outcome.UNRESOLVED)  # skip without running
    assert session.current is not None
    session.decide(Outcome.GOOD)
    summary = session.run_to_end()
    assert summary.person_steps == 3
    assert summary.unresolved_steps == 1
    assert calls.count(7) == 1 and 3 not in calls
    lines = records(log)
    person = [line for line in lines if line.get("decided_by") == "person"]
    assert person[0]["auto_observation"]["outcome"] == "good"
    assert person[0]["observation"]["note"] == "saw the wrong weight by eye"
    assert person[1]["observation"]["outcome"] == "unresolved"
    assert person[1]["auto_observation"] is None


def test_a_person_confirming_the_first_failure_sets_the_target() -> None:
    other = Signature("nonfinite", frozenset({"nonfinite"}))

    def predicate(probe: ItemProbe[int]) -> Observation:
        return (
            Observation.unresolved("crash of another kind", TARGET)
            if probe.index == 9
            else (Observation.bad(other) if probe.index == 4 else stream_predicate(6)(probe))
        )

    session = Session(FirstBadSearch(list(range(10))), predicate)
    assert session.evaluate().outcome is Outcome.UNRESOLVED
    session.decide(Outcome.BAD)  # the person knows this is the bug
    assert session.search.target == TARGET
    summary = session.run_to_end()
    assert summary.result is not None and summary.result.first_bad == 6  # index 4 (another bug) was skipped


def test_manual_session_without_predicate(tmp_path: Path) -> None:
    session = Session(FirstBadSearch(list(range(4))))
    with pytest.raises(BisectError, match="no predicate"):
        session.step()
    session.decide(Outcome.BAD)
    while not session.done:
        probe = session.current
        assert probe is not None
        session.decide(Outcome.BAD if probe.index >= 2 else Outcome.GOOD)
    summary = session.summary()
    assert summary.result is not None and summary.result.first_bad == 2
    assert summary.target is None  # a person's bad on the starting point sets no signature
    with pytest.raises(BisectError):
        session.decide(Outcome.GOOD)


def test_resume_replays_the_log_without_running_the_predicate(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    first = Session(FirstBadSearch(list(range(200))), stream_predicate(123), log_path=log)
    first.step()
    first.step()
    first.decide(Outcome.UNRESOLVED)
    recorded = [step.probe_key for step in first.steps]
    del first  # the session "dies"

    calls: list[int] = []
    resumed = Session.resume(FirstBadSearch(list(range(200))), log, stream_predicate(123, calls))
    assert [step.probe_key for step in resumed.steps] == recorded
    assert calls == []
    summary = resumed.run_to_end()
    assert summary.result is not None and summary.result.first_bad == 123
    assert summary.person_steps == 1
    assert not set(calls) & set(recorded)
    lines = records(log)
    assert [line["number"] for line in lines if line["record"] == "step"] == list(range(1, summary.steps + 1))
    assert sum(line["record"] == "summary" for line in lines) == 1
    # A finished log resumes to the same result, and appends nothing.
    again = Session.resume(FirstBadSearch(list(range(200))), log)
    assert again.done and again.summary().result == summary.result
    assert records(log) == lines


def test_resume_ddmin_and_shape_searches(tmp_path: Path) -> None:
    mutations = ["a", "b", "c", "d", "e"]

    def mutation_predicate(probe: SubsetProbe[str]) -> Observation:
        return Observation.good() if {"b", "e"} <= set(probe.items) else Observation.bad(TARGET)

    log = tmp_path / "mutations.jsonl"
    session = Session(MutationSearch(mutations), mutation_predicate, log_path=log)
    session.run_to_end(max_steps=4)
    assert not session.done
    resumed = Session.resume(MutationSearch(mutations), log, mutation_predicate)
    result = resumed.run_to_end().result
    assert result is not None and result.names(result.minimal) == ["b", "e"]

    def shape_predicate(probe: ShapeProbe) -> Observation:
        return Observation.bad(TARGET) if probe.shape["tokens"] >= 5 else Observation.good()

    dimensions = [Dimension.stepped("experts", 8), Dimension.stepped("tokens", 16)]
    shape_log = tmp_path / "shape.jsonl"
    Session(ShapeSearch(dimensions), shape_predicate, log_path=shape_log).run_to_end(max_steps=3)
    shape = Session.resume(ShapeSearch(dimensions), shape_log, shape_predicate).run_to_end().result
    assert shape is not None and dict(shape.minimal) == {"experts": 1, "tokens": 5}


def test_resume_refuses_a_log_of_another_search(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    Session(FirstBadSearch(list(range(20))), stream_predicate(5), log_path=log).run_to_end(max_steps=2)
    with pytest.raises(BisectLogError, match="different calls search"):
        Session.resume(FirstBadSearch(list(range(21))), log)
    with pytest.raises(BisectLogError, match="not a mutations one"):
        Session.resume(MutationSearch(["a"]), log)
    with pytest.raises(BisectLogError, match=r"differs in target.*--fresh"):
        Session.resume(FirstBadSearch(list(range(20)), target=TARGET), log)


@pytest.mark.parametrize(
    "build",
    [
        lambda settings: FirstBadSearch(list(range(20)), settings=settings),
        lambda settings: MutationSearch(["a", "b"], settings=settings),
        lambda settings: ShapeSearch([Dimension.stepped("tokens", 16)], settings=settings),
        lambda settings: PackSearch(["v1", "v2", "v3"], settings=settings),
    ],
    ids=["calls", "mutations", "shape", "packs"],
)
def test_settings_are_logged_and_a_resume_needs_equal_ones(tmp_path: Path, build) -> None:
    """What the predicate does beyond the search (mutations, backend …) decides the answer: part of the log's config."""
    log = tmp_path / "log.jsonl"
    settings = {"call": 1, "mutations": ["fill 0xff"], "backend": "auto"}
    search = build(settings)
    Session(search, log_path=log)
    assert records(log)[0]["config"] == search.config()
    assert {name: search.config()[name] for name in settings} == settings
    Session.resume(build(dict(settings)), log)  # equal settings: resumes
    changes = [
        ({**settings, "mutations": []}, "mutations"),
        ({**settings, "backend": "vllm"}, "backend"),
        ({"call": 1}, "backend, mutations"),
    ]
    for changed, differs in changes:
        with pytest.raises(BisectLogError, match=rf"differs in {differs}\); start afresh with --fresh"):
            Session.resume(build(changed), log)


def test_settings_are_json_and_do_not_redefine_the_search() -> None:
    with pytest.raises(BisectError, match="redefine match"):
        FirstBadSearch([1, 2], settings={"match": "any"}).config()
    with pytest.raises(BisectError, match="JSON data"):
        FirstBadSearch([1, 2], settings={"backend": object()})


def test_resume_refuses_a_log_whose_steps_do_not_follow_the_search(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    Session(FirstBadSearch(list(range(20))), stream_predicate(5), log_path=log).run_to_end(max_steps=3)
    lines = records(log)
    lines[2]["probe"]["key"] = 4
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(BisectLogError, match="another search"):
        Session.resume(FirstBadSearch(list(range(20))), log)


def test_a_cut_off_last_line_is_dropped_and_trimmed(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    Session(FirstBadSearch(list(range(64))), stream_predicate(40), log_path=log).run_to_end(max_steps=3)
    with log.open("a") as stream:
        stream.write('{"record": "step", "numb')
    logged = read_log(log)
    assert logged.dropped_partial_line and len(logged.steps) == 3
    resumed = Session.resume(FirstBadSearch(list(range(64))), log, stream_predicate(40))
    resumed.run_to_end()
    assert all(line for line in records(log))  # every line parses again


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no session header"),
        ("not json\n", "not a JSON line"),
        ('{"record": "step"}\n', "first record must be the session header"),
        ('{"record": "session", "format": 99}\n', "unsupported log format"),
        ('{"record": "session", "format": 1}\n{"record": "bogus"}\n', "unknown record"),
        (
            '{"record": "session", "format": 1}\n'
            '{"record": "step", "number": 2, "probe": {"key": 1, "label": "1"}, '
            '"observation": {"outcome": "good"}, "decided_by": "auto"}\n',
            "step 2 where step 1",
        ),
        (
            '{"record": "session", "format": 1}\n'
            '{"record": "step", "number": 1, "probe": {"key": 1, "label": "1"}, '
            '"observation": {"outcome": "good"}, "decided_by": "robot"}\n',
            "unknown decider",
        ),
        (
            '{"record": "session", "format": 1}\n{"record": "summary", "summary": {}}\n{"record": "step"}\n',
            "after",
        ),
        ("[1, 2]\n", "JSON object"),
    ],
)
def test_malformed_logs_raise_one_clear_error(tmp_path: Path, content: str, message: str) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text(content)
    with pytest.raises(BisectLogError, match=message) as caught:
        read_log(log)
    assert isinstance(caught.value, MoereplayError)
    assert "\n" not in str(caught.value)


def test_missing_log_is_a_log_error(tmp_path: Path) -> None:
    with pytest.raises(BisectLogError, match="cannot read"):
        read_log(tmp_path / "absent.jsonl")


def test_an_existing_log_is_not_overwritten_silently(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    Session(FirstBadSearch([0, 1]), log_path=log)
    with pytest.raises(BisectLogError, match="already exists"):
        Session(FirstBadSearch([0, 1]), log_path=log)
    Session(FirstBadSearch([0, 1]), log_path=log, overwrite=True)


def test_invalid_mutation_raised_by_the_predicate_is_unresolved() -> None:
    def predicate(probe: SubsetProbe[str]) -> Observation:
        if "bad" in probe.items and len(probe.items) < 3:
            raise InvalidMutationError("moe_block_size 7 is not one of 8, 16, 32, 64")
        return Observation.good() if "fix" in probe.items else Observation.bad(TARGET)

    session = Session(MutationSearch(["bad", "fix", "other"]), predicate)
    summary = session.run_to_end()
    assert summary.result is not None and summary.result.names(summary.result.undetermined) == ["bad"]
    notes = [
        step.observation.note for step in session.steps if step.observation.outcome is Outcome.UNRESOLVED
    ]
    assert notes and notes[0].startswith("InvalidMutationError: moe_block_size 7")


def test_other_errors_of_the_predicate_propagate() -> None:
    def predicate(probe: ItemProbe[int]) -> Observation:
        raise ReplayError("capture file vanished")

    with pytest.raises(ReplayError):
        Session(FirstBadSearch([0, 1]), predicate).step()
