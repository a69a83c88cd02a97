"""BusConnection.read_stored against a real server: in stream order, with stream sequences, and on
from a point (a repair or recovery reads on from where the last read ended)."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import ServiceUnavailableError

from shared.bus import connection, subjects
from shared.runtime.errors import BusUnavailable
from tests.support.bus import bus_client, consumer_requests


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


@pytest.mark.parametrize("batch", [2, 512])
async def test_a_read_up_to_a_stored_sequence_merges_its_filters_in_order_without_a_consumer(nats_url: str, batch: int) -> None:
    """A worker's read at placement, bounded by its barrier: every filter's messages up to the
    bound in stream order, pages of `batch` merged across filters, nothing after the bound, and
    no consumer (the server answers direct gets; an open storm made one per call and partition)."""
    async with bus_client(nats_url, "test-read-upto") as conn:
        cid = subjects.new_cid()
        for i in range(5):
            await conn.store(subjects.input_(cid, "a"), f"a{i}".encode())
            await conn.store(subjects.out(cid), b"not read")
            await conn.store(subjects.edge(cid, "b"), f"b{i}".encode())
        await conn.store(subjects.abort(cid), b"abort")
        barrier = await conn.store(subjects.placed(cid, "w1"), b"placed")
        await conn.store(subjects.input_(cid, "a"), b"after the barrier")
        filters = [subjects.consumed(cid, "a"), subjects.consumed(cid, "b"), subjects.abort(cid), subjects.fin(cid)]
        async with consumer_requests(nats_url) as requests:
            read = [m async for m in conn.read_stored(filters, batch=batch, upto=barrier)]
            rest = [body async for _, body, _ in conn.read_stored(filters, after=read[6][2], batch=batch, upto=barrier)]
        assert requests == []
        assert [body for _, body, _ in read] == [b"a0", b"b0", b"a1", b"b1", b"a2", b"b2", b"a3", b"b3", b"a4", b"b4", b"abort"]
        seqs = [seq for _, _, seq in read]
        assert seqs == sorted(seqs) and seqs[-1] < barrier
        assert read[0][0] == subjects.input_(cid, "a") and read[1][0] == subjects.edge(cid, "b")
        assert rest == [b"b3", b"a4", b"b4", b"abort"]
        # Unbounded, the same read goes on past the barrier, through a consumer.
        async with consumer_requests(nats_url) as requests:
            assert [body async for _, body, _ in conn.read_stored(filters, after=seqs[-1])] == [b"after the barrier"]
        # Any consumer request shows it (the create, its pulls, its delete): in about one run
        # in five beside other modules the watcher saw the pulls and the delete but not the
        # create, which the read made all the same (it read the message).
        assert any(r.startswith("$JS.API.CONSUMER.") for r in requests), requests


async def test_a_read_whose_consumer_has_no_leader_yet_asks_again(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a cluster, a read's consumer just made takes no pull until its leader is elected: the
    server answers no responders (503). The read asks again and reads everything (before, it
    failed: a worker's catch-up read at placement gave up, and the gap read had to mend it);
    once the consumer has answered, a 503 fails the read at once."""
    real = JetStreamContext.PullSubscription.fetch
    leaderless = [2]

    async def fetch(self: JetStreamContext.PullSubscription, *args: Any, **kwargs: Any) -> list[Msg]:
        if leaderless[0] > 0:
            leaderless[0] -= 1
            raise ServiceUnavailableError
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", fetch)
    async with bus_client(nats_url, "test-read-leaderless") as conn:
        cid = subjects.new_cid()
        for i in range(4):
            await conn.store(subjects.out(cid), f"o{i}".encode())
        assert [body async for _, body, _ in conn.read_stored([subjects.out(cid)], batch=2)] == [b"o0", b"o1", b"o2", b"o3"]
        assert leaderless == [0]
        leaderless[0] = 10**6  # a consumer that never gets a leader: the read fails after the bound
        monkeypatch.setattr(connection, "LEADERLESS_WAIT_S", 0.3)
        with pytest.raises(BusUnavailable):
            [m async for m in conn.read_stored([subjects.out(cid)], batch=2)]
        leaderless[0] = 0
        read = conn.read_stored([subjects.out(cid)], batch=2)
        assert [body for _, body, _ in [await anext(read), await anext(read)]] == [b"o0", b"o1"]
        leaderless[0] = 1  # the consumer answered once: a 503 now is not a leader being elected
        with pytest.raises(BusUnavailable):
            await anext(read)
        await read.aclose()
