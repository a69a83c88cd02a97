"""The two wire protocols an eval speaks, as pure translators: the messages a sample sends
at each stage, and what each message the server sends means (`core.Event`). The runner
does the socket I/O.

- `generate-ws`: duplexbus's own `WS /generate/ws` (docs/clients.md), one live call per
  socket. The opening and appends get no acknowledgement; `end_input` ends the call's
  input (appends after it are refused, client rule 6), the worker steps the call on
  without input while its model has work, and the `finish` ends the call. So nothing is
  padded (nor before `end_input`: that silence would be input; docs/eval.md, "Padding").
- `realtime`: the OpenAI Realtime API (`WS /v1/realtime`, GA event names, with the beta
  names accepted on the way in). One session per sample: `session.created`, then a
  `session.update` that declares the clip's rate, `input_audio_buffer.append`s,
  `input_audio_buffer.commit`, and silence appends after it until the reply has drained
  (the session's input stays open, so a model that steps on input keeps stepping).
"""

from __future__ import annotations

import itertools
import json
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pybase64

from clients.eval.core import Event, Kind

PROTOCOLS = ("generate-ws", "realtime")
DEFAULT_URLS = {"generate-ws": "ws://127.0.0.1:8000/generate/ws", "realtime": "ws://127.0.0.1:8000/v1/realtime"}


@dataclass
class HandshakeStep:
    send: list[str]  # messages to send first
    wait_for: str | None  # the event name that completes the step (None: nothing to wait for)


class Protocol:
    name = ""
    pads_after_end = False  # silence appends go on after the end of input until the reply drains
    commit_acked = False  # the end of input is acknowledged by a COMMITTED event
    close_after_terminal = False  # the close waits for the call's TERMINAL event first

    def __init__(self, rate: int, model: str | None = None) -> None:
        self.rate = rate  # of the input audio
        self.model = model
        self.call_id = ""

    def url(self, base: str) -> str:
        return base

    def handshake(self) -> list[HandshakeStep]:
        raise NotImplementedError

    def append(self, pcm: bytes) -> str:
        raise NotImplementedError

    def end_input(self) -> list[str]:
        raise NotImplementedError

    def classify(self, raw: str | bytes) -> list[Event]:
        raise NotImplementedError

    def commit_redundant(self, ev: Event) -> bool:
        """An error that only says the end of input was already taken (not a failure)."""
        return False


def _json(raw: str | bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


class GenerateWS(Protocol):
    name = "generate-ws"
    close_after_terminal = True

    def __init__(self, rate: int, model: str | None = None) -> None:
        super().__init__(rate, model)
        self.request_id = f"eval-{secrets.token_hex(6)}"

    def handshake(self) -> list[HandshakeStep]:
        opening: dict[str, Any] = {"request_id": self.request_id}
        if self.model:
            opening["model"] = self.model
        return [HandshakeStep([json.dumps(opening)], None)]  # an opening gets no reply unless refused

    def append(self, pcm: bytes) -> str:
        data = pybase64.b64encode(pcm).decode("ascii")
        return json.dumps({"request_id": self.request_id, "append": [{"name": "mic.pcm", "data": data}]})

    def end_input(self) -> list[str]:
        return [json.dumps({"request_id": self.request_id, "end_input": True})]

    def classify(self, raw: str | bytes) -> list[Event]:
        m = _json(raw)
        if not isinstance(m, dict):
            return [Event(Kind.ERROR, "invalid_json", code="invalid_json", text=str(raw)[:200])]
        if "output" in m and isinstance(m["output"], dict):
            return [self._output(m["output"])]
        if "finish" in m:
            finish = m["finish"] if isinstance(m["finish"], dict) else {}
            self.call_id = str(finish.get("call_id") or "")
            return [Event(Kind.TERMINAL, "finish", call_id=self.call_id, text=str(finish.get("reason", "")))]
        if "error" in m:
            name = "append_error" if m.get("append") else "error"
            return [Event(Kind.ERROR, name, code=str(m.get("status", "")), text=str(m["error"]))]
        return [Event(Kind.OTHER, "unknown")]

    def _output(self, o: dict[str, Any]) -> Event:
        """A model's output event. Audio is reply audio; `reply` opens a reply, `reply_end` and
        `barge_in` close it (voice_assistant); `listen`, `speak` and transcripts acknowledge
        input. An output this does not know counts as neither."""
        kind = o.get("type")
        if isinstance(o.get("audio"), str):
            return Event(Kind.REPLY_AUDIO, str(kind or "audio"), audio=pybase64.b64decode(o["audio"]),
                         rate=int(o.get("sample_rate") or self.rate))  # fmt: skip
        if kind == "reply":
            return Event(Kind.REPLY_START, "reply", text=str(o.get("text", "")))
        if kind in ("reply_end", "barge_in"):
            return Event(Kind.REPLY_END, str(kind))
        if kind in ("text", "text_delta"):
            return Event(Kind.REPLY_TEXT, str(kind), text=str(o.get("text", o.get("delta", ""))))
        if kind == "transcript":
            return Event(Kind.TRANSCRIPT if o.get("final") else Kind.LISTEN, "transcript", text=str(o.get("text", "")))
        if kind == "speak":
            return Event(Kind.TURN_END, "speak", waited_s=_waited(o.get("at"), o.get("end_at")))
        if kind == "listen":
            return Event(Kind.LISTEN, "listen")
        return Event(Kind.OTHER, str(kind or "output"))


# Server events of the Realtime API, GA names first, then the beta names some servers still send.
_AUDIO_DELTA = {"response.output_audio.delta", "response.audio.delta"}
_TEXT_DELTA = {
    "response.output_audio_transcript.delta",
    "response.output_text.delta",
    "response.audio_transcript.delta",
    "response.text.delta",
}
_TRANSCRIPTION_DONE = "conversation.item.input_audio_transcription.completed"
COMMIT_EMPTY = "input_audio_buffer_commit_empty"


class Realtime(Protocol):
    """`turn_detection`: None for manual commits (the end of input is a commit, acknowledged
    by `input_audio_buffer.committed`), or "server_vad": the server's own turn-taking decides,
    so nothing is committed (duplexbus refuses a commit in that mode; OpenAI commits by
    itself) and the end of input is the end of the clip, padding going on from there.
    `response_create`: send `response.create` after the commit (OpenAI and duplexbus answer a
    manual commit only when asked; False for a server that answers it by itself)."""

    name = "realtime"
    pads_after_end = True

    def __init__(
        self,
        rate: int,
        model: str | None = None,
        turn_detection: str | None = None,
        response_create: bool = True,
        transcription_model: str | None = None,
    ) -> None:
        super().__init__(rate, model)
        self.turn_detection = turn_detection
        self.commit_acked = turn_detection is None
        self.response_create = response_create
        self.transcription_model = transcription_model
        self.out_rate = rate  # asked for in session.update; the server's session says what it took
        self._ids = itertools.count()

    def url(self, base: str) -> str:
        if not self.model:
            return base
        parts = urlsplit(base)
        query = dict(parse_qsl(parts.query))
        query.setdefault("model", self.model)
        return urlunsplit(parts._replace(query=urlencode(query)))

    def _event(self, kind: str, **fields: Any) -> str:
        return json.dumps({"type": kind, "event_id": f"evt_eval_{next(self._ids)}", **fields})

    def session(self) -> dict[str, Any]:
        fmt = {"type": "audio/pcm", "rate": self.rate}
        td = {"type": self.turn_detection} if self.turn_detection else None
        audio_in: dict[str, Any] = {"format": fmt, "turn_detection": td}
        if self.transcription_model:
            audio_in["transcription"] = {"model": self.transcription_model}
        return {"type": "realtime", "audio": {"input": audio_in, "output": {"format": fmt}}}

    def handshake(self) -> list[HandshakeStep]:
        return [
            HandshakeStep([], "session.created"),
            HandshakeStep([self._event("session.update", session=self.session())], "session.updated"),
        ]

    def append(self, pcm: bytes) -> str:
        return self._event("input_audio_buffer.append", audio=pybase64.b64encode(pcm).decode("ascii"))

    def end_input(self) -> list[str]:
        if self.turn_detection is not None:
            return []
        out = [self._event("input_audio_buffer.commit")]
        if self.response_create:
            out.append(self._event("response.create"))
        return out

    def classify(self, raw: str | bytes) -> list[Event]:
        m = _json(raw)
        if not isinstance(m, dict) or not isinstance(m.get("type"), str):
            return [Event(Kind.ERROR, "invalid_json", code="invalid_json", text=str(raw)[:200])]
        kind: str = m["type"]
        if kind in _AUDIO_DELTA:
            return [Event(Kind.REPLY_AUDIO, kind, audio=pybase64.b64decode(str(m.get("delta", ""))), rate=self.out_rate)]
        if kind in _TEXT_DELTA:
            return [Event(Kind.REPLY_TEXT, kind, text=str(m.get("delta", "")))]
        if kind == "response.created":
            return [Event(Kind.REPLY_START, kind)]
        if kind == "response.done":
            resp = _dict(m.get("response"))
            status = str(resp.get("status", ""))
            waited = _dict(_dict(resp.get("usage")).get("latency_ms")).get("end_of_turn")  # duplexbus's own usage figure
            waited_s = waited / 1000 if isinstance(waited, int | float) else None
            reason = _status_reason(resp)
            return [Event(Kind.REPLY_END, kind, code=status, failed=status == "failed", text=reason, waited_s=waited_s)]
        if kind == "input_audio_buffer.speech_stopped":
            return [Event(Kind.TURN_END, kind)]
        if kind == "input_audio_buffer.committed":
            return [Event(Kind.COMMITTED, kind)]
        if kind == _TRANSCRIPTION_DONE:
            return [Event(Kind.TRANSCRIPT, kind, text=str(m.get("transcript", "")))]
        if kind in ("session.created", "session.updated"):
            sess = _dict(m.get("session"))
            if sess.get("id"):
                self.call_id = str(sess["id"])
            self._output_rate(sess)
            return [Event(Kind.SESSION, kind, call_id=self.call_id)]
        if kind == "error":
            err = _dict(m.get("error"))
            code = str(err.get("code") or err.get("type") or "error")
            return [Event(Kind.ERROR, kind, code=code, text=str(err.get("message", "")))]
        if kind.startswith(("input_audio_buffer.", "conversation.item.")):
            return [Event(Kind.LISTEN, kind)]
        return [Event(Kind.OTHER, kind)]

    def _output_rate(self, sess: dict[str, Any]) -> None:
        """The rate the server will send reply audio at, where it says: the session's output format."""
        fmt = _dict(_dict(_dict(sess.get("audio")).get("output")).get("format"))
        rate = fmt.get("rate", fmt.get("sample_rate_hz"))  # duplexbus says sample_rate_hz for rates other than 24 kHz
        if isinstance(rate, int) and rate > 0:
            self.out_rate = rate

    def commit_redundant(self, ev: Event) -> bool:
        # With server VAD the server may have committed everything itself already.
        return ev.kind is Kind.ERROR and ev.code == COMMIT_EMPTY


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _status_reason(resp: dict[str, Any]) -> str:
    details = resp.get("status_details")
    if isinstance(details, dict):
        err = details.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err.get("code") or "")
        return str(details.get("reason") or "")
    return ""


def make(name: str, rate: int, model: str | None = None, **realtime: Any) -> Protocol:
    if name == "generate-ws":
        return GenerateWS(rate, model)
    if name == "realtime":
        return Realtime(rate, model, **realtime)
    raise ValueError(f"unknown protocol {name!r}: one of {', '.join(PROTOCOLS)}")


def _waited(at: Any, end_at: Any) -> float | None:
    """A `speak` output's end-of-turn delay (`at - end_at`, seconds of the call's audio)."""
    if isinstance(at, int | float) and isinstance(end_at, int | float):
        return max(0.0, float(at) - float(end_at))
    return None
