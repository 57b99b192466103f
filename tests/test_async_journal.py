"""The async cloud's push journal (``cloud.async_journal.PushJournal``) under faults: the newest version sent each cell
(``sent``) as a resumed cloud reads it after a crash mid-append, and the file's size over a long job."""

from __future__ import annotations

from pathlib import Path

from cloud.async_journal import PushJournal


def test_a_torn_sent_entry_is_a_version_never_sent_and_the_journal_stays_one_versions_size(tmp_path: Path) -> None:
    """Each version and resend appends a ``sent`` entry (fsynced before it goes out). A cloud killed mid-append of
    the entry for version 302 to c0 never sent it: the resumed journal gives c0 version 301 (its push from 302 is
    refused as never sent), c1 its own, and it appends after the torn bytes are cut. Over versions 10 to 298, each
    with a resend to every cell, the file holds one version's entries (each version's start rewrites it with the
    map): no growth with the job's length."""
    path = tmp_path / "journal"
    journal = PushJournal(path, None)
    cells = [f"c{i}" for i in range(5)]
    sizes = []
    for version in range(10, 299, 32):  # (10 versions)
        journal.applied(version)
        journal.sending(cells, version)
        for cell in cells:
            journal.sending([cell], version)  # a resend (at most one a cell and version: RoundCounts.first_resend)
        sizes.append(path.stat().st_size)
    assert max(sizes) < 1.3 * sizes[0], sizes  # (a few digits more), not 10 versions of entries
    journal.applied(300)
    journal.sending(["c0", "c1"], 300)
    journal.close()
    resumed = PushJournal(path, 301)
    assert resumed.sent is not None and resumed.sent["c0"] == 300 and resumed.sent["c3"] == 298
    resumed.sending(["c0"], 301)
    resumed.close()
    with path.open("ab") as fh:
        fh.write(b"\x40\x00\x00\x00torn")  # killed mid-append of the next one: version 302 to c0, never sent
    again = PushJournal(path, 302)
    assert again.sent is not None and again.sent["c0"] == 301 and again.sent["c1"] == 300
    again.sending(["c1"], 302)  # appended after the cut tail: read whole again
    again.close()
    last = PushJournal(path, 302)
    assert last.sent is not None and last.sent["c1"] == 302 and last.sent["c0"] == 301
    last.close()
