"""A worker spec the fleet runner did not write (hand-edited, truncated, of another program) stops the worker
with one line naming the file and what is wrong, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from durable_fleet.worker import DeviceSpec, WorkerSpec, main

GOOD = WorkerSpec(
    device_port=1,
    broker_host="127.0.0.1",
    broker_port=2,
    logs="logs",
    state_dir="state",
    keepalive=5,
    end_sessions=False,
    devices=[DeviceSpec("d0", "paho")],
)


def good_fields(tmp_path: Path) -> dict[str, object]:
    path = tmp_path / "good.json"
    GOOD.dump(path)
    fields: dict[str, object] = json.loads(path.read_text(encoding="utf-8"))
    return fields


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("{not json", "ValueError: not UTF-8 JSON"),
        ("[1, 2]", "ValueError: not a JSON object but an array"),
        ('{"devices": ["d0"], "publisher": null}', "TypeError"),
        ('{"devices": [], "publisher": null}', "TypeError"),
        ('{"publisher": null}', "KeyError: 'devices'"),
    ],
)
def test_a_spec_that_is_not_the_runners_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str
) -> None:
    path = tmp_path / "spec.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit) as exited:
        main([str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{path} is not a worker spec the fleet runner wrote: " in err and said in err, err
    assert "Traceback" not in err


def test_a_device_entry_with_an_unknown_field_and_a_missing_file_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fields = good_fields(tmp_path)
    fields["devices"] = [{"name": "d0", "kind": "paho", "colour": "red"}]
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(fields), encoding="utf-8")
    for spec in (path, tmp_path / "absent.json"):
        with pytest.raises(SystemExit) as exited:
            main([str(spec)])
        assert exited.value.code == 2
        assert f"{spec} is not a worker spec the fleet runner wrote: " in capsys.readouterr().err


def test_the_runners_own_spec_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    GOOD.dump(path)
    assert WorkerSpec.load(path) == GOOD
