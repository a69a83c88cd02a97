"""`GuardedClient`'s read loop (`internals.FastParser`): the messages it takes in its own loop
reach their handlers exactly as nats-py's parser hands them over, whatever the reads' cuts, and
what it does not take (headers, other subscriptions, unknown ids) goes the old way, in order.
Pure (a client never connected, fed bytes by hand), then against a real nats-server."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol import parser as nats_parser

from bench import nats_py_paths
from shared.bus import internals

DIRECT, QUEUED, ONCE, UNKNOWN = 1, 2, 3, 99


def _stream(rng: random.Random, n: int) -> bytes:
    """The bytes of n server messages of every kind a client reads (and +OK lines)."""
    out = bytearray()
    for i in range(n):
        sid = rng.choice([DIRECT, DIRECT, DIRECT, QUEUED, ONCE, UNKNOWN])
        subject = f"call.c{i % 7}.in.audio_in".encode()
        payload = rng.randbytes(rng.choice([0, 1, 13, 2600, 70_000]))
        reply = f"_INBOX.r{i}".encode() if rng.random() < 0.3 else b""
        kind = rng.random()
        if kind < 0.15:
            hdr = f"NATS/1.0\r\nNats-Msg-Id: m{i}\r\n\r\n".encode()
            line = b"HMSG %s %d %s%d %d\r\n" % (subject, sid, reply + b" " if reply else b"", len(hdr), len(hdr) + len(payload))
            out += line + hdr + payload + b"\r\n"
        else:
            line = b"MSG %s %d %s%d\r\n" % (subject, sid, reply + b" " if reply else b"", len(payload))
            out += line + payload + b"\r\n"
        if kind > 0.95:
            out += b"+OK\r\n"
    return bytes(out)


def _client(cls: type[Client]) -> tuple[Client, list[tuple[Any, ...]]]:
    """A client of `cls` with a direct subscription, one with nats-py's queue and one that
    ends after 2 messages; what each one got is recorded in the list."""
    nc = cls()
    got: list[tuple[Any, ...]] = []

    def record(m: Msg) -> None:
        got.append(("direct", m.subject, m.reply, m.data, m.headers, m.sid))

    direct = Subscription(nc, DIRECT, "call.*.in.audio_in", cb=_never)
    direct._pending_queue = internals._Direct(record, direct)  # type: ignore[assignment]
    nc._subs[DIRECT] = direct
    nc._subs[QUEUED] = Subscription(nc, QUEUED, "call.>", cb=_never)
    nc._subs[ONCE] = Subscription(nc, ONCE, "call.>", cb=_never, max_msgs=2)
    return nc, got


async def _never(m: Msg) -> None:
    raise AssertionError("a subscription's own task is not running here")


def _queued(sub: Subscription) -> list[tuple[Any, ...]]:
    out = []
    while not sub._pending_queue.empty():
        m = sub._pending_queue.get_nowait()
        out.append((m.subject, m.reply, m.data, m.headers))
    return out


@pytest.mark.parametrize("seed", range(6))
async def test_the_fast_read_hands_over_what_nats_pys_parser_does_whatever_the_cuts(seed: int) -> None:
    rng = random.Random(seed)
    data = _stream(rng, 400)
    cuts = [*sorted(rng.sample(range(1, len(data)), 300)), len(data)]
    if seed == 0:
        cuts = [*range(1, 4000), len(data)]  # a byte at a time through the first messages
    fast, fast_got = _client(internals.GuardedClient)
    plain, plain_got = _client(Client)
    fast_subs, plain_subs = dict(fast._subs), dict(plain._subs)
    assert isinstance(fast._ps, internals.FastParser) and not isinstance(plain._ps, internals.FastParser)
    start = 0
    for end in cuts:
        await fast._ps.parse(data[start:end])
        await plain._ps.parse(data[start:end])
        start = end
    assert len(fast_got) > 100
    assert fast_got == plain_got
    for sid in (QUEUED, ONCE):
        queued_fast, queued_plain = _queued(fast_subs[sid]), _queued(plain_subs[sid])
        assert queued_fast and queued_fast == queued_plain
    assert ONCE not in fast._subs and ONCE not in plain._subs  # both ended it after its 2 messages
    assert fast.stats == plain.stats
    for sid in (DIRECT, QUEUED):
        assert fast._subs[sid]._received == plain._subs[sid]._received
        assert fast._subs[sid]._pending_size == plain._subs[sid]._pending_size
    assert not fast._ps.buf and not plain._ps.buf


def _plain(first: int, n: int) -> bytes:
    """n plain messages to the direct subscription, numbered from `first`."""
    bodies = [b"m%d" % i for i in range(first, first + n)]
    return b"".join(b"MSG call.c1.in.audio_in %d %d\r\n%s\r\n" % (DIRECT, len(body), body) for body in bodies)


def _slow_path(nc: Client) -> list[int]:
    """Counts the messages that reach nats-py's own `_process_msg` (its parser's way)."""
    slow: list[int] = []
    process = nc._process_msg

    async def counted(sid: int, *args: Any) -> None:
        slow.append(sid)
        await process(sid, *args)

    nc._process_msg = counted  # type: ignore[method-assign,assignment]
    return slow


@pytest.mark.parametrize("seed", range(3))
async def test_reads_cut_inside_plain_messages_stay_on_the_fast_path(seed: int) -> None:
    # Under load a read ends inside a message more often than not; nats-py's parser, once
    # it held that half, took the whole next read, so most messages missed the fast loop.
    rng = random.Random(seed)
    data = _plain(0, 500)
    cuts = [*sorted(rng.sample(range(1, len(data)), 200)), len(data)]
    nc, got = _client(internals.GuardedClient)
    slow = _slow_path(nc)
    start = 0
    for end in cuts:
        await nc._ps.parse(data[start:end])
        start = end
    assert [m[3] for m in got] == [b"m%d" % i for i in range(500)]
    assert slow == []
    assert not nc._ps.buf and nc._ps.state == nats_parser.AWAITING_CONTROL_LINE


async def test_a_plain_message_nats_pys_parser_began_is_finished_on_the_fast_path() -> None:
    hdr = b"NATS/1.0\r\n\r\n"
    head = b"HMSG call.c1.in.audio_in %d %d %d\r\n%shm\r\n" % (DIRECT, len(hdr), len(hdr) + 2, hdr)
    cut = _plain(0, 1)
    data = head + cut[:-4], cut[-4:] + _plain(1, 50)
    nc, got = _client(internals.GuardedClient)
    slow = _slow_path(nc)
    await nc._ps.parse(data[0])  # the header message, and a plain one's line and part of its payload
    assert nc._ps.state == nats_parser.AWAITING_MSG_PAYLOAD and slow == [DIRECT]
    await nc._ps.parse(data[1])
    assert [m[3] for m in got] == [b"hm", *(b"m%d" % i for i in range(51))]
    assert slow == [DIRECT]  # the header message only
    assert not nc._ps.buf and nc._ps.state == nats_parser.AWAITING_CONTROL_LINE


async def test_a_malformed_msg_line_is_refused_as_nats_py_refuses_it() -> None:
    for bad in (b"MSG subj x 3\r\nabc\r\n", b"MSG subj 1 -3\r\nabc\r\n", b"MSG subj\r\n"):
        fast, _ = _client(internals.GuardedClient)
        plain, _ = _client(Client)
        errors: list[type[Exception] | None] = []
        for nc in (fast, plain):
            try:
                await nc._ps.parse(bad)
                errors.append(None)
            except Exception as e:
                errors.append(type(e))
        assert errors[0] is not None and errors[0] == errors[1], bad


def test_without_the_parsers_internals_the_client_keeps_nats_pys_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(nats_parser, "MAX_CONTROL_LINE_SIZE")
    nc = internals.GuardedClient()
    assert type(nc._ps) is nats_parser.Parser
    assert "nats.protocol.parser.MAX_CONTROL_LINE_SIZE" in internals.missing_client_internals(nc)


async def test_a_guarded_client_reads_every_message_of_a_real_server_in_order(nats_url: str) -> None:
    nc = internals.GuardedClient()
    await nc.connect(nats_url)
    try:
        assert isinstance(nc._ps, internals.FastParser)
        got: list[tuple[bytes, str, str | None]] = []
        queued: list[bytes] = []

        def on(m: Msg) -> None:
            got.append((m.data, m.reply, (m.headers or {}).get("k")))

        async def on_queued(m: Msg) -> None:
            queued.append(m.data)

        await internals.subscribe_direct(nc, "fast.parse.*", on)
        await nc.subscribe("fast.other", cb=on_queued)
        rng = random.Random(7)
        sent = []
        pub = internals.GuardedClient()
        await pub.connect(nats_url)
        try:
            for i in range(3000):
                body = rng.randbytes(rng.choice([0, 5, 2600, 100_000]))
                reply = f"r.{i}" if i % 5 == 0 else ""
                headers = {"k": str(i)} if i % 11 == 0 else None
                sent.append((body, reply, None if headers is None else str(i)))
                await pub.publish(f"fast.parse.{i % 3}", body, reply=reply, headers=headers)
                if i % 10 == 0:
                    await pub.publish("fast.other", str(i).encode())
            await pub.flush()
        finally:
            await pub.close()
        for _ in range(200):
            if len(got) == len(sent) and len(queued) == 300:
                break
            await asyncio.sleep(0.05)
        assert got == sent
        assert queued == [str(i).encode() for i in range(0, 3000, 10)]
    finally:
        await nc.close()


async def test_the_benchmark_of_both_read_paths_runs_and_counts_every_message(nats_url: str) -> None:
    for guarded in (False, True):
        assert 0 < await nats_py_paths.read_us(nats_url, guarded, 100, 200) < 1e4  # asserts every message arrived


@pytest.mark.parametrize("argv", [["--pairs", "0"], ["--messages", "5"], ["--size", "-1"]])
def test_the_read_benchmark_refuses_what_it_cannot_measure(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        nats_py_paths.cli(argv)
    assert e.value.code == 2 and "must be at least" in capsys.readouterr().err
