"""BusConnection.read_stored against a real server: in stream order, with stream sequences, and on
from a point (a repair or recovery reads on from where the last read ended)."""

from __future__ import annotations

from shared.bus import subjects
from tests.support.bus import bus_client


async def test_read_stored_reads_everything_or_on_from_a_sequence(nats_url: str) -> None:
    async with bus_client(nats_url, "test-read-stored") as conn:
        cid = subjects.new_cid()
        for i in range(5):
            await conn.store(subjects.out(cid), f"o{i}".encode())
            await conn.store(subjects.input_(cid, "other"), b"not read")
        await conn.store_once(subjects.fin(cid), b"fin")
        filters = [subjects.out(cid), subjects.fin(cid)]
        everything = [m async for m in conn.read_stored(filters)]
        assert [body for _, body, _ in everything] == [b"o0", b"o1", b"o2", b"o3", b"o4", b"fin"]
        seqs = [seq for _, _, seq in everything]
        assert seqs == sorted(seqs) and len(set(seqs)) == 6
        rest = [body async for _, body, _ in conn.read_stored(filters, after=seqs[2])]
        assert rest == [b"o3", b"o4", b"fin"]
        assert [m async for m in conn.read_stored(filters, after=seqs[-1])] == []
