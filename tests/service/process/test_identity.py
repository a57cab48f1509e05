"""Identity: a new boot id each start, a counter of starts kept atomically in the state dir."""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from neuron_trio.errors import ConfigError
from neuron_trio.service.process.identity import Identity, StateDirError


def test_counts_starts(tmp_path: Path) -> None:
    state = tmp_path / "a" / "b"
    first = Identity.create(state)
    second = Identity.create(state)
    assert (first.starts, second.starts) == (1, 2)
    assert first.boot_id != second.boot_id and re.fullmatch(r"[0-9a-f]{32}", first.boot_id)
    assert (state / "starts").read_text() == "2\n"
    assert sorted(p.name for p in state.iterdir()) == ["running", "starts"]  # no temporary file


def test_started_at_is_rfc3339_utc(tmp_path: Path) -> None:
    ident = Identity.create(tmp_path, now=datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=UTC))
    assert ident.started_at == "2026-01-02T03:04:05.600Z"
    assert ident.to_dict() == {
        "boot_id": ident.boot_id,
        "started_at": "2026-01-02T03:04:05.600Z",
        "starts": 1,
    }
    assert datetime.fromisoformat(Identity.create(tmp_path).started_at).tzinfo is not None


def test_damaged_counter_counts_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "starts").write_text("garbage")
    assert Identity.create(tmp_path).starts == 1
    assert "not a count" in caplog.text


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes")
def test_unwritable_state_dir_names_the_path(tmp_path: Path) -> None:
    state = tmp_path / "ro"
    state.mkdir()
    state.chmod(0o500)
    try:
        with pytest.raises(StateDirError, match=re.escape(str(state))) as info:
            Identity.create(state)
        assert isinstance(info.value, ConfigError)
    finally:
        state.chmod(0o700)


def test_state_dir_that_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StateDirError, match=re.escape(str(blocker / "state"))):
        Identity.create(blocker / "state")


def test_a_start_after_an_unclean_stop_says_so(tmp_path: Path) -> None:
    first = Identity.create(tmp_path)
    assert first.previous_stop_clean  # the first start follows nothing
    assert (tmp_path / "running").read_text() == first.boot_id + "\n"
    second = Identity.create(tmp_path)  # the first never stopped cleanly (a kill, exit 70)
    assert not second.previous_stop_clean
    second.record_clean_stop()
    assert not (tmp_path / "running").exists()
    third = Identity.create(tmp_path)
    assert third.previous_stop_clean and third.starts == 3
