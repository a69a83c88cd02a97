"""One realtime session as a pure state machine: client events and model outputs in,
realtime server events and call actions out. No I/O (the shell, `endpoint.py`, does it).

One session is one live call whose audio stream stays open for the whole session. Audio
is resampled from the session's rate to the model's on the way in and back on the way out
(soxr; nothing at equal rates). With server VAD it streams into the call as it comes; with
manual commits the buffer is held here until `input_audio_buffer.commit`, then sent as one
piece. The model's outputs become realtime events through its `RealtimeMapping`.

Turns: with server VAD the model's own turn-taking decides them (the session's settings
reach it through the mapping's `set_turn_detection`) and, where the session says
`create_response`, its reply starts a response. Otherwise (`create_response: false`, or
manual commits) a reply the model begins is held here until the client's `response.create`,
which it then fills: a commit alone starts nothing.

Every event gets an `event_id` numbered in order (`event_<session>_<n>`, which is how a
resuming client says what it last saw), and every response that is created ends with
exactly one `response.done`: completed, cancelled (the client, or a barge-in), incomplete
(no reply came, or the call ended first) or failed (the call failed).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.frontend.realtime import events as ev
from shared.bus import subjects, wire
from shared.runtime.states import checked
from shared.runtime.stats import turn_latency
from shared.sdk.audio import Resampler, b64_pcm16, resample_pcm16
from shared.sdk.realtime import (
    InputTranscript,
    ModelEvent,
    RealtimeMapping,
    ReplyAudio,
    ReplyCut,
    ReplyEnded,
    ReplyStarted,
    ReplyText,
    SpeechStarted,
    SpeechStopped,
    TurnSettings,
    TurnTaking,
)

# The layout of `RealtimeSession.snapshot`: raised with any change to the session's attributes
# (or to what one holds), so a frontend never takes up a session left by one that laid it
# out otherwise (a resume across two releases is refused before anything moves).
STATE_FORMAT = 1
KEEP_ITEMS = 64  # assistant items a truncate may name (the most recent ones)
KEEP_CONVERSATION = 256  # conversation items a retrieve or delete may name (the most recent ones)
MIN_COMMIT_MS = 100  # OpenAI's least committed audio (input_audio_buffer_commit_empty below it)
HELD_MAX_EVENTS = 4096  # a held reply's model events (about 5 min of 80 ms audio); past it the rest is dropped


class SessionState(enum.Enum):
    ACTIVE = "active"
    CLOSING = "closing"  # session.close: input ended, the call finishing
    CLOSED = "closed"  # the call ended; nothing more comes


SESSION_MOVES = {
    SessionState.ACTIVE: {SessionState.CLOSING, SessionState.CLOSED},
    SessionState.CLOSING: {SessionState.CLOSED},
    SessionState.CLOSED: set[SessionState](),
}


class ResponseState(enum.Enum):
    WAITING = "waiting"  # made by response.create; the model's reply has not begun
    SPEAKING = "speaking"  # the model's reply fills it
    DONE = "done"  # response.done sent


RESPONSE_MOVES = {
    ResponseState.WAITING: {ResponseState.SPEAKING, ResponseState.DONE},
    ResponseState.SPEAKING: {ResponseState.DONE},
    ResponseState.DONE: set[ResponseState](),
}


# -- actions for the shell -------------------------------------------------------------
@dataclass
class SendAudio:
    """Append these samples (PCM16 at the model's rate) to the call's audio stream."""

    pcm: np.ndarray
    event_id: str | None = None  # the client event it came from (named in an error if refused)


@dataclass
class SendText:
    text: str
    event_id: str | None = None


@dataclass
class EndCallInput:
    pass


@dataclass
class Close:
    """Close the socket (the session is over)."""

    code: int
    reason: str


CallAction = SendAudio | SendText | EndCallInput | Close


@dataclass
class Out:
    events: list[dict[str, Any]] = field(default_factory=list)
    actions: list[CallAction] = field(default_factory=list)
    turns: list[TurnLatency] = field(default_factory=list)  # of the responses done (the frontend's histograms)


@dataclass
class SessionLimits:
    """What the session needs to know of the model and the serving config."""

    native_rate: int  # the model's audio stream
    item_size: int  # samples per model item: a commit is padded to whole items
    max_samples: int | None  # the most samples the call's stream takes (held buffers are checked against it)
    response_wait_s: float  # how long a response made by response.create waits for the model's reply
    has_text: bool = False  # the model has a text stream


TURN_STAGES = ("end_of_turn", "transcript", "first_audio")  # usage.latency_ms's keys, in turn_latency's order


@dataclass
class TurnLatency:
    """One turn's latency as the session sees it (its clock): the turn decided (speech_stopped),
    its final transcript, the first audio of the reply to it; and the end of turn's own delay
    in the call's audio (end of speech to the decision), where the model reports it."""

    decided: float
    waited_s: float | None = None
    transcript_at: float | None = None
    first_audio_at: float | None = None

    def figures_ms(self) -> dict[str, int | None]:
        """`end_of_turn`: end of speech to the decision; `transcript`: the decision to the final
        transcript; `first_audio`: end of speech to the reply's first audio (from the decision
        where the model does not report the end of speech)."""

        figures = turn_latency(self.decided, self.waited_s, self.transcript_at, self.first_audio_at)
        return {k: None if s is None else round(s * 1000) for k, s in zip(TURN_STAGES, figures, strict=True)}


@dataclass
class Response:
    id: str
    item_id: str
    modalities: list[str]
    deadline: float
    metadata: dict[str, Any] | None = None
    state: ResponseState = ResponseState.WAITING
    resampler: Resampler | None = None
    audio_samples: int = 0  # sent to the client, at the session's output rate
    transcript: list[str] = field(default_factory=list)
    latency: TurnLatency | None = None  # of the turn it answers (server VAD), once its first audio went out

    def move(self, to: ResponseState) -> None:
        self.state = checked(f"response {self.id}", self.state, to, RESPONSE_MOVES)


def resume_token(cid: str, secret: str) -> str:
    """The token a session's client resumes it with: its call's id, which any frontend can
    ask the bus for (`subjects.realtime_take`), and a secret only the session's holder knows."""
    return f"{cid}.{secret}"


def token_cid(token: str) -> str | None:
    """The call id a resume token names (None: not a token of this form)."""
    cid, dot, secret = token.partition(".")
    return cid if dot and secret and subjects.is_cid(cid) else None


def event_number(event_id: str | None) -> int | None:
    """n of `event_<session>_<n>` (what a resuming client last saw); None for anything else."""
    if not event_id:
        return None
    tail = event_id.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


class RealtimeSession:
    def __init__(self, sid: str, model: str, mapping: RealtimeMapping, limits: SessionLimits, resume_token: str) -> None:
        self.sid = sid
        self.model = model
        self.mapping = mapping
        self.limits = limits
        self.resume_token = resume_token
        self.state = SessionState.ACTIVE
        self.n = 0  # events emitted
        self.ids = 0  # response and item ids made
        self.now = 0.0  # the clock of the last event in (handle, on_output, tick)
        # The session's settings (session.update).
        self.input_rate = ev.DEFAULT_RATE
        self.output_rate = ev.DEFAULT_RATE
        self.server_vad = True
        self.turn = ev.TurnDetection()  # server VAD's settings, as the client gave them
        self.transcription: dict[str, Any] | None = None
        self.instructions = ""
        self.modalities = ["audio"]
        self.beta = False
        self.mapping.set_server_vad(True)
        self.taking: TurnTaking = self.mapping.set_turn_detection(TurnSettings())
        self.resampler = Resampler(self.input_rate, limits.native_rate)
        # Input.
        self.buffer: list[np.ndarray] = []  # manual mode: held until commit, at the model's rate
        self.buffered = 0
        self.stream_pos = 0  # samples sent to the call
        self.last_item: str | None = None  # the conversation's last item (previous_item_id)
        self.speech_item: str | None = None  # server VAD: the item of the turn being spoken
        self.input_item: str | None = None  # the item input transcripts are about
        self.partial = ""  # its partial transcript so far
        self.awaiting = 0  # turns sent to the model that no reply has begun to answer yet
        self.last_turn: TurnLatency | None = None  # the latest turn no reply has spoken to yet
        self.idle_at: float | None = None  # idle_timeout_ms: when it fires (None: not armed)
        self.idle_from = 0  # the stream position the idle span began at
        # Output.
        self.response: Response | None = None
        self.dropping = False  # the model's current reply was cancelled: its outputs are dropped
        self.skip_next_reply = False  # a waiting response was cancelled: drop the next reply
        self.held: list[ModelEvent] | None = None  # a reply begun with no response to fill: for the next response.create
        self.holding = False  # the model's current reply goes into `held`
        self.last_response: str | None = None  # the id of the last response made
        self.items: OrderedDict[str, int] = OrderedDict()  # assistant item -> audio ms sent (truncate)
        self.conversation: OrderedDict[str, dict[str, Any]] = OrderedDict()  # item id -> item (retrieve, delete)
        self._out = Out()

    # -- emitting ----------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        self.n += 1
        self._out.events.append({"event_id": f"event_{self.sid}_{self.n}", "type": kind, **fields})

    def _act(self, action: CallAction) -> None:
        self._out.actions.append(action)

    def _take(self) -> Out:
        out, self._out = self._out, Out()
        return out

    def _new_id(self, prefix: str) -> str:
        self.ids += 1
        return f"{prefix}_{self.sid}_{self.ids}"

    def _move(self, to: SessionState) -> None:
        self.state = checked(f"realtime session {self.sid}", self.state, to, SESSION_MOVES)

    def error(self, code: str, message: str, param: str | None = None, client_event_id: str | None = None) -> Out:
        """The GA error envelope; the session goes on."""
        self._emit_error(code, message, param, client_event_id)
        return self._take()

    def refused(self, e: ev.ClientError) -> Out:
        return self.error(e.code, e.message, e.param, e.event_id)

    # -- the session object ------------------------------------------------------------
    @staticmethod
    def _format(rate: int) -> dict[str, Any]:
        # The SDK's type allows `rate` 24000 only; another rate is named in `sample_rate_hz`.
        return {"type": "audio/pcm", "rate": rate} if rate == ev.DEFAULT_RATE else {"type": "audio/pcm", "sample_rate_hz": rate}

    @property
    def auto_response(self) -> bool:
        """A reply the model begins starts a response by itself (server VAD's create_response)."""
        return self.server_vad and self.turn.create_response

    def _turn_detection(self) -> dict[str, Any] | None:
        """The turn detection in effect: the values the model's turn-taking runs with, and
        (`unsupported`, our extension) each setting given that it cannot honour, with why."""
        if not self.server_vad:
            return None
        t, taking = self.turn, self.taking
        vad: dict[str, Any] = {"type": "semantic_vad" if t.semantic else "server_vad"}
        if t.semantic:
            vad["eagerness"] = t.eagerness or "auto"
        else:
            vad.update(
                threshold=taking.threshold,
                prefix_padding_ms=taking.prefix_padding_ms,
                silence_duration_ms=taking.silence_duration_ms,
                idle_timeout_ms=t.idle_timeout_ms,
            )
        vad.update(create_response=t.create_response, interrupt_response=t.interrupt_response, detector=taking.detector)
        unsupported = dict(taking.unsupported)
        if not t.interrupt_response and self.mapping.barges_in:
            unsupported["interrupt_response"] = "the model stops its own reply when the caller talks over it"
        if unsupported:
            vad["unsupported"] = unsupported
        return vad

    def session_object(self) -> dict[str, Any]:
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": f"sess_{self.sid}",
            "model": self.model,
            "output_modalities": list(self.modalities),
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": self._format(self.input_rate),
                    "turn_detection": self._turn_detection(),
                    "transcription": self.transcription,
                },
                "output": {"format": self._format(self.output_rate)},
            },
            "resume_token": self.resume_token,
            "native_sample_rate_hz": self.limits.native_rate,
        }

    def created(self) -> Out:
        self._emit("session.created", session=self.session_object())
        return self._take()

    # -- client events -----------------------------------------------------------------
    def handle(self, event: ev.ClientEvent, now: float) -> Out:
        a, eid = event.action, event.event_id
        self.now = now
        if self.state is not SessionState.ACTIVE and not isinstance(a, ev.PlaybackAck | ev.Heartbeat):
            return self.error("session_closed", "the session is closing (session.close); no more input is taken", None, eid)
        if isinstance(a, ev.SessionUpdate):
            self._update(a)
        elif isinstance(a, ev.AppendAudio):
            self._append(a.pcm, eid)
        elif isinstance(a, ev.Commit):
            self._commit(eid)
        elif isinstance(a, ev.Clear):
            self._clear()
        elif isinstance(a, ev.ResponseCreate):
            self._response_create(a, eid)
        elif isinstance(a, ev.ResponseCancel):
            self._response_cancel(a, eid)
        elif isinstance(a, ev.ItemCreate):
            self._item_create(a, eid)
        elif isinstance(a, ev.ItemTruncate):
            self._truncate(a, eid)
        elif isinstance(a, ev.ItemRetrieve):
            self._retrieve(a.item_id, eid)
        elif isinstance(a, ev.ItemDelete):
            self._delete(a.item_id, eid)
        elif isinstance(a, ev.OutputClear):
            self._output_clear()
        elif isinstance(a, ev.PlaybackAck):
            self._emit("playback.acknowledged", **a.fields)
        elif isinstance(a, ev.Heartbeat):
            self._emit("session.heartbeat")
        elif isinstance(a, ev.SessionClose):
            self._close()
        else:  # session.resume reaches the core only on a socket that has a session already
            self._emit_error("invalid_value", "session.resume must be the first event on a new socket", "type", eid)
        return self._take()

    def _emit_error(self, code: str, message: str, param: str | None, eid: str | None) -> None:
        kind = "server_error" if code in ("server_error", "server_busy") else "invalid_request_error"
        self._emit("error", error={"type": kind, "code": code, "message": message, "param": param, "event_id": eid})

    def _update(self, u: ev.SessionUpdate) -> None:
        if u.input_rate is not None and u.input_rate != self.input_rate:
            self._route(self.resampler.flush(), None)
            self.input_rate = u.input_rate
            self.resampler = Resampler(u.input_rate, self.limits.native_rate)
        if u.output_rate is not None:
            self.output_rate = u.output_rate
        if u.server_vad is not None and u.server_vad != self.server_vad:
            self.server_vad = u.server_vad
            self.mapping.set_server_vad(u.server_vad)
            if u.server_vad and self.buffer:  # held audio joins the stream, uncommitted
                self._send(np.concatenate(self.buffer), None)
                self._drop_buffer()
        if u.turn_detection is not None:
            t = self.turn = u.turn_detection
            self.taking = self.mapping.set_turn_detection(
                TurnSettings(t.semantic, t.threshold, t.prefix_padding_ms, t.silence_duration_ms, t.eagerness)
            )
        self._arm_idle(0.0)
        if u.transcription is not None:
            self.transcription = u.transcription
        if u.instructions is not None:
            self.instructions = u.instructions
        if u.output_modalities is not None:
            self.modalities = u.output_modalities
        self.beta = self.beta or u.beta
        self._emit("session.updated", session=self.session_object())

    def _append(self, pcm: np.ndarray, eid: str | None) -> None:
        native = self.resampler.push(pcm)
        if self.server_vad:
            self._send(native, eid)
            return
        cap = self.limits.max_samples
        if cap is not None and self.stream_pos + self.buffered + len(native) > cap:
            self._emit_error(
                "input_audio_buffer_full",
                f"the buffer would pass the call's bound of {cap} samples at {self.limits.native_rate} Hz"
                " (client_streams.audio_in.max_items / max_call_input_mb); commit or clear it",
                "audio",
                eid,
            )
            return
        self._hold(native)

    def _hold(self, native: np.ndarray) -> None:
        if len(native):
            self.buffer.append(native)
            self.buffered += len(native)

    def _route(self, native: np.ndarray, eid: str | None) -> None:
        """Samples out of the input resampler: to the call (server VAD) or the held buffer."""
        if self.server_vad:
            self._send(native, eid)
        else:
            self._hold(native)

    def _send(self, native: np.ndarray, eid: str | None) -> None:
        if len(native):
            self._act(SendAudio(native, eid))
            self.stream_pos += len(native)

    def _drop_buffer(self) -> None:
        self.buffer, self.buffered = [], 0

    @staticmethod
    def _too_small(ms: float) -> str:
        # OpenAI's words: clients (LiveKit's plugin under server VAD) match on the code.
        return (
            "Error committing input audio buffer: buffer too small."
            f" Expected at least {MIN_COMMIT_MS}ms of audio, but buffer only has {ms:.2f}ms of audio."
        )

    def _commit(self, eid: str | None) -> None:
        if self.server_vad:
            # Server VAD streams every append to the model, whose turn-taking commits: the buffer
            # a client commits is always empty, as OpenAI's is once its VAD has committed it.
            self._emit_error("input_audio_buffer_commit_empty", self._too_small(0.0), None, eid)
            return
        self._hold(self.resampler.flush())
        ms = self.buffered * 1000 / self.limits.native_rate
        if ms < MIN_COMMIT_MS:
            self._emit_error("input_audio_buffer_commit_empty", self._too_small(ms), None, eid)
            return
        pcm = np.concatenate(self.buffer)
        self._drop_buffer()
        item = self._new_id("item")
        self._send_turn(pcm, eid)
        self._emit("input_audio_buffer.committed", item_id=item, previous_item_id=self.last_item)
        self._user_item(item, [{"type": "input_audio", "transcript": None}])
        self.input_item, self.partial = item, ""

    def _send_turn(self, pcm: np.ndarray, eid: str | None) -> None:
        """One committed piece of audio: padded to whole model items and the model's commit padding."""
        start, n = self.stream_pos, len(pcm)
        size = self.limits.item_size
        pad = round(self.mapping.commit_padding_s * self.limits.native_rate)
        pad = -(-(n + pad) // size) * size - n
        self._send(np.concatenate([pcm, np.zeros(pad, dtype=np.int16)]), eid)
        self.mapping.committed(start, n)
        self.awaiting += 1

    def _user_item(self, item: str, content: list[dict[str, Any]], role: str = "user") -> None:
        body = {"id": item, "object": "realtime.item", "type": "message", "role": role, "status": "completed", "content": content}
        previous, self.last_item = self.last_item, item
        self._remember(body)
        self._emit("conversation.item.added", previous_item_id=previous, item=body)
        if self.beta:
            self._emit("conversation.item.created", previous_item_id=previous, item=body)
        self._emit("conversation.item.done", previous_item_id=previous, item=body)

    def _remember(self, item: dict[str, Any]) -> None:
        self.conversation[item["id"]] = item
        while len(self.conversation) > KEEP_CONVERSATION:
            self.conversation.popitem(last=False)

    def _clear(self) -> None:
        if not self.server_vad:
            self.resampler.flush()
            self._drop_buffer()
        self._emit("input_audio_buffer.cleared")

    def _response_create(self, a: ev.ResponseCreate, eid: str | None) -> None:
        r = self.response
        if r is not None:
            self._emit_error(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: {r.id}."
                " Wait until the response is finished before creating a new one.",
                None,
                eid,
            )
            return
        modalities = a.output_modalities or self.modalities
        if self.held is not None:  # the model's reply to the turn, held for this request
            held, self.held = self.held, None
            r = self._start_response(modalities, self.now, a.metadata)
            r.move(ResponseState.SPEAKING)
            # What the model said so far, then (where it has not ended) the rest as it comes.
            self.holding = False
            for m in held:
                self._model_event(m)
            return
        if not self.awaiting:
            # Nothing sent to the model waits for an answer: the served models take no prompt
            # of their own, so the response is empty, at once (not incomplete seconds later).
            self._start_response(modalities, self.now, a.metadata)
            self._finish("completed")
            return
        self._start_response(modalities, self.now + self.limits.response_wait_s, a.metadata)

    def _response_cancel(self, a: ev.ResponseCancel, eid: str | None) -> None:
        r = self.response
        if r is None or (a.response_id is not None and a.response_id != r.id):
            # OpenAI's words: clients (LiveKit's plugin) stay quiet for this message only.
            self._emit_error("response_cancel_not_active", "Cancellation failed: no active response found", "response_id", eid)
            return
        if r.state is ResponseState.SPEAKING:
            self.dropping = True
        else:
            self.skip_next_reply = True
        self._finish("cancelled", reason="client_cancelled")

    def _item_create(self, a: ev.ItemCreate, eid: str | None) -> None:
        if a.item_id is not None and a.item_id in self.conversation:
            self._emit_error("item_create_duplicate_item_id", f"Item with id {a.item_id!r} already exists.", "item.id", eid)
            return
        item = a.item_id or self._new_id("item")
        if a.role != "user":  # kept as a conversation item; the model takes no such input
            self._user_item(item, [{"type": "input_text", "text": a.text or ""}], role=a.role)
            return
        content: list[dict[str, Any]] = []
        if a.text is not None:
            if not self.limits.has_text:
                self._emit_error("invalid_value", f"model {self.model!r} takes no text input", "item.content", eid)
                return
            self._act(SendText(a.text, eid))
            self.awaiting += 1
            content.append({"type": "input_text", "text": a.text})
        if a.pcm is not None:
            self._send_turn(resample_pcm16(a.pcm, self.input_rate, self.limits.native_rate), eid)
            content.append({"type": "input_audio", "transcript": None})
        self._user_item(item, content)
        self.input_item, self.partial = item, ""

    def _truncate(self, a: ev.ItemTruncate, eid: str | None) -> None:
        sent = self.items.get(a.item_id)
        if sent is None:
            why = f"no assistant audio item {a.item_id!r} to truncate"
            self._emit_error("item_truncate_invalid_item_id", why, "item_id", eid)
            return
        if a.content_index != 0:
            self._emit_error("invalid_value", "content_index must be 0 (the item's audio)", "content_index", eid)
            return
        self._emit("conversation.item.truncated", item_id=a.item_id, content_index=0, audio_end_ms=min(a.audio_end_ms, sent))

    def _retrieve(self, item_id: str, eid: str | None) -> None:
        item = self.conversation.get(item_id)
        if item is None:
            self._emit_error("item_retrieve_invalid_item_id", f"no conversation item {item_id!r} to retrieve", "item_id", eid)
            return
        self._emit("conversation.item.retrieved", item=item)

    def _delete(self, item_id: str, eid: str | None) -> None:
        if self.conversation.pop(item_id, None) is None:
            self._emit_error("item_delete_invalid_item_id", f"no conversation item {item_id!r} to delete", "item_id", eid)
            return
        self.items.pop(item_id, None)
        if self.last_item == item_id:
            self.last_item = next(reversed(self.conversation), None)
        self._emit("conversation.item.deleted", item_id=item_id)

    def _output_clear(self) -> None:
        """The client's playback buffer is its own on a socket: nothing to drop here but what
        is still held; the response goes on until `response.cancel` (Pipecat sends both).
        `cleared` names the response in progress, or the last one (the SDK's type needs one;
        with none yet there is nothing it could be about, and none is sent)."""
        self.held, self.holding = None, False
        r = self.response
        rid = r.id if r is not None else self.last_response
        if rid is not None:
            self._emit("output_audio_buffer.cleared", response_id=rid)

    def _close(self) -> None:
        self._drop_buffer()
        self._move(SessionState.CLOSING)
        self._act(EndCallInput())

    # -- model outputs -----------------------------------------------------------------
    def on_output(self, output: dict[str, Any], now: float) -> Out:
        self.now = now
        if self.state is SessionState.CLOSED:
            return self._take()
        for m in self.mapping.on_output(output):
            self._model_event(m)
        return self._take()

    def _model_event(self, m: ModelEvent) -> None:
        if isinstance(m, SpeechStarted | SpeechStopped):
            if self.server_vad:
                self._speech(m)
        elif isinstance(m, InputTranscript):
            self._transcript(m)
        elif isinstance(m, ReplyStarted):
            self._reply_started()
        elif self.holding:
            self._hold_reply(m)
        elif self.dropping or self.response is None or self.response.state is not ResponseState.SPEAKING:
            if isinstance(m, ReplyEnded | ReplyCut):
                self.dropping = False
        elif isinstance(m, ReplyAudio):
            self._reply_audio(self.response, m)
        elif isinstance(m, ReplyText):
            self._reply_text(self.response, m.delta)
        elif isinstance(m, ReplyEnded):
            self._reply_audio(self.response, None)
            self._finish("completed")
        else:
            sent = self.items.get(self.response.item_id, 0)
            played = min(round(m.played_s * 1000), sent)
            self._emit("conversation.item.truncated", item_id=self.response.item_id, content_index=0, audio_end_ms=played)
            self._finish("cancelled", reason="turn_detected")

    def _hold_reply(self, m: ModelEvent) -> None:
        held = self.held
        assert held is not None
        if isinstance(m, ReplyCut):  # cut before anyone asked for it: nothing to answer with
            self.held, self.holding = None, False
            return
        if len(held) < HELD_MAX_EVENTS or isinstance(m, ReplyEnded):
            held.append(m)
        if isinstance(m, ReplyEnded):
            self.holding = False

    def _speech(self, m: SpeechStarted | SpeechStopped) -> None:
        ms = round(m.at_s * 1000)
        if isinstance(m, SpeechStarted):
            self.idle_at = None
            self.awaiting = 0  # a new turn: the model answers it, not the ones before
            self.speech_item = self._new_id("item")
            self.input_item, self.partial = self.speech_item, ""
            self._emit("input_audio_buffer.speech_started", audio_start_ms=ms, item_id=self.speech_item)
            r = self.response
            cut = self.turn.interrupt_response and not self.mapping.barges_in
            if cut and r is not None and r.state is ResponseState.SPEAKING:
                self.dropping = True  # the rest of the reply the caller talked over is dropped
                self._finish("cancelled", reason="turn_detected")
            return
        item = self.speech_item or self._new_id("item")
        self.speech_item = None
        waited = m.at_s - m.speech_end_s if m.speech_end_s is not None else None
        self.last_turn = TurnLatency(self.now, waited)
        self.awaiting += 1
        self._arm_idle(0.0)
        self._emit("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=item)
        self._emit("input_audio_buffer.committed", item_id=item, previous_item_id=self.last_item)
        self._user_item(item, [{"type": "input_audio", "transcript": None}])
        if self.input_item != item:
            self.input_item, self.partial = item, ""

    def _transcript(self, m: InputTranscript) -> None:
        item = self.input_item
        if item is None:
            return
        if m.final:
            if self.last_turn is not None and self.last_turn.transcript_at is None:
                self.last_turn.transcript_at = self.now
            body = self.conversation.get(item)
            if body is not None and body["content"] and body["content"][0].get("type") == "input_audio":
                body["content"][0]["transcript"] = m.text
            self._emit(
                "conversation.item.input_audio_transcription.completed",
                item_id=item,
                content_index=0,
                transcript=m.text,
                usage={"type": "tokens", "input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
            )
            self.partial = ""
        elif m.text.startswith(self.partial) and len(m.text) > len(self.partial):
            # Deltas only add: a hypothesis that rewrote earlier words waits for the final one.
            delta, self.partial = m.text[len(self.partial) :], m.text
            self._emit("conversation.item.input_audio_transcription.delta", item_id=item, content_index=0, delta=delta)

    def _reply_started(self) -> None:
        self.dropping = False
        self.awaiting = max(0, self.awaiting - 1)
        if self.skip_next_reply:
            self.skip_next_reply, self.dropping = False, True
            return
        r = self.response
        if r is not None and r.state is ResponseState.SPEAKING:
            self._finish("cancelled", reason="turn_detected")
            r = None
        if r is None and not self.auto_response:
            # No response asked for it yet: held for the client's response.create (a second
            # reply before it joins the first, as one answer to the turns it covers).
            if self.held is None:
                self.held = []
            elif self.held and isinstance(self.held[-1], ReplyEnded):
                self.held.pop()
            self.holding = True
            return
        if r is None:
            r = self._start_response(self.modalities, self.now)
        r.move(ResponseState.SPEAKING)

    def _start_response(self, modalities: list[str], deadline: float, metadata: dict[str, Any] | None = None) -> Response:
        self.idle_at = None
        r = Response(self._new_id("resp"), self._new_id("item"), list(modalities), deadline, metadata)
        self.response, self.last_response = r, r.id
        self._emit("response.created", response=self._response_body(r, "in_progress"))
        self._emit("rate_limits.updated", rate_limits=[])
        item = self._assistant_item(r, "in_progress", with_content=False)
        self._emit("response.output_item.added", response_id=r.id, output_index=0, item=item)
        previous, self.last_item = self.last_item, r.item_id
        self._remember(item)
        self._emit("conversation.item.added", previous_item_id=previous, item=item)
        if self.beta:
            self._emit("conversation.item.created", previous_item_id=previous, item=item)
        self._emit("response.content_part.added", **self._part_ids(r), part=self._part(r))
        self.items[r.item_id] = 0
        while len(self.items) > KEEP_ITEMS:
            self.items.popitem(last=False)
        return r

    @staticmethod
    def _part_ids(r: Response) -> dict[str, Any]:
        return {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}

    @staticmethod
    def _part(r: Response) -> dict[str, Any]:
        text = "".join(r.transcript)
        return {"type": "audio", "transcript": text} if "audio" in r.modalities else {"type": "text", "text": text}

    def _assistant_item(self, r: Response, status: str, with_content: bool = True) -> dict[str, Any]:
        text = "".join(r.transcript)
        part = {"type": "output_audio", "transcript": text} if "audio" in r.modalities else {"type": "output_text", "text": text}
        return {
            "id": r.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part] if with_content else [],
        }

    def _response_body(self, r: Response, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": r.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": []
            if status == "in_progress"
            else [self._assistant_item(r, "completed" if status == "completed" else "incomplete")],
            "conversation_id": f"conv_{self.sid}",
            "output_modalities": r.modalities,
            "audio": {"output": {"format": self._format(self.output_rate)}},
            "metadata": r.metadata,
        }
        if status != "in_progress":
            body["usage"] = {
                "total_tokens": 0,
                "input_tokens": 0,
                "output_tokens": 0,
                "audio_out_ms": self.items.get(r.item_id, 0),
            }
            if r.latency is not None:
                body["usage"]["latency_ms"] = r.latency.figures_ms()
        return body

    def _reply_audio(self, r: Response, m: ReplyAudio | None) -> None:
        """A piece of reply audio (None: the reply ended; what the resampler holds goes out)."""
        if m is not None and r.resampler is None:
            r.resampler = Resampler(m.rate, self.output_rate)
        if r.resampler is None:
            return
        pcm = r.resampler.push(m.pcm) if m is not None else r.resampler.flush()
        words = m.transcript if m is not None else ""
        if "audio" in r.modalities:
            if len(pcm) and r.audio_samples == 0 and self.last_turn is not None:
                r.latency, self.last_turn = self.last_turn, None
                r.latency.first_audio_at = self.now
            if len(pcm):
                r.audio_samples += len(pcm)
                self.items[r.item_id] = r.audio_samples * 1000 // self.output_rate
                self._emit("response.output_audio.delta", **self._part_ids(r), delta=b64_pcm16(pcm))
            if words:
                r.transcript.append(words)
                self._emit("response.output_audio_transcript.delta", **self._part_ids(r), delta=words)
        elif words:
            self._reply_text(r, words)

    def _reply_text(self, r: Response, delta: str) -> None:
        r.transcript.append(delta)
        kind = "response.output_audio_transcript.delta" if "audio" in r.modalities else "response.output_text.delta"
        self._emit(kind, **self._part_ids(r), delta=delta)

    def _finish(self, status: str, reason: str | None = None, error: dict[str, Any] | None = None) -> None:
        """The response's closing events, ending in its one response.done."""
        r = self.response
        assert r is not None
        r.move(ResponseState.DONE)
        self.response = None
        ids = self._part_ids(r)
        text = "".join(r.transcript)
        if "audio" in r.modalities:
            self._emit("response.output_audio.done", **ids)
            self._emit("response.output_audio_transcript.done", **ids, transcript=text)
        else:
            self._emit("response.output_text.done", **ids, text=text)
        self._emit("response.content_part.done", **ids, part=self._part(r))
        item = self._assistant_item(r, "completed" if status == "completed" else "incomplete")
        if r.item_id in self.conversation:
            self._remember(item)
        self._emit("response.output_item.done", response_id=r.id, output_index=0, item=item)
        self._emit("conversation.item.done", previous_item_id=None, item=item)
        details = None if status == "completed" else {"type": status, "reason": reason, "error": error}
        self._emit("response.done", response=self._response_body(r, status, details))
        if r.latency is not None:
            self._out.turns.append(r.latency)
        # idle_timeout_ms counts from the end of the reply's playback (played in real time).
        self._arm_idle(r.audio_samples / self.output_rate)

    # -- time and the call's end ---------------------------------------------------------
    def _arm_idle(self, after_s: float) -> None:
        """idle_timeout_ms (server VAD): armed after a response's audio and after a turn."""
        t = self.turn.idle_timeout_ms
        if not self.server_vad or t is None:
            self.idle_at = None
            return
        self.idle_at = self.now + after_s + t / 1000
        self.idle_from = self.stream_pos

    def _idle_timeout(self) -> None:
        """OpenAI's: the span since the last turn is committed as an (empty) user item and,
        with create_response, answered by a response; the served models take no prompt of
        their own, so it is an empty one."""
        rate = self.limits.native_rate
        item = self._new_id("item")
        start_ms, end_ms = self.idle_from * 1000 // rate, self.stream_pos * 1000 // rate
        self._emit("input_audio_buffer.timeout_triggered", audio_start_ms=start_ms, audio_end_ms=end_ms, item_id=item)
        self._emit("input_audio_buffer.committed", item_id=item, previous_item_id=self.last_item)
        self._user_item(item, [{"type": "input_audio", "transcript": None}])
        if self.turn.create_response:
            self._start_response(self.modalities, self.now)
            self._finish("completed")
        else:
            self._arm_idle(0.0)

    def tick(self, now: float) -> Out:
        self.now = now
        r = self.response
        if r is not None and r.state is ResponseState.WAITING and now >= r.deadline:
            wait = self.limits.response_wait_s
            self.awaiting = 0
            self._finish(
                "incomplete",
                error={"type": "server_error", "code": "no_reply", "message": f"the model did not reply within {wait:g} s"},
            )
        idle = self.idle_at is not None and now >= self.idle_at
        if idle and self.state is SessionState.ACTIVE and self.response is None and self.speech_item is None and not self.holding:
            self._idle_timeout()
        return self._take()

    def call_ended(self, status: int, message: str) -> Out:
        """The call finished (200) or ended with an error status; the session is over."""
        if self.state is SessionState.CLOSED:
            return self._take()
        failed = status != 200
        if self.response is not None:
            error = {"type": "server_error", "code": _code(status), "message": message} if failed else None
            self._finish("failed" if failed else "incomplete", error=error)
        if failed:
            self._emit_error(_code(status), message, None, None)
        closing = self.state is SessionState.CLOSING
        self._move(SessionState.CLOSED)
        if closing and not failed:
            self._emit("session.closed")
        self._act(Close(*_close_code(status)))
        return self._take()

    # -- moving to another frontend -----------------------------------------------------
    def let_go(self) -> Out:
        """The session is about to move to another frontend: what its resamplers hold goes
        out now (the input's into the call or the held buffer, the reply's as its audio), so
        no sample is lost and the filters start afresh there, as at a change of rate."""
        self._route(self.resampler.flush(), None)
        r = self.response
        if r is not None and r.state is ResponseState.SPEAKING and not self.dropping and not self.holding:
            self._reply_audio(r, None)
        return self._take()

    def snapshot(self, now: float) -> bytes:
        """The session as data (`restored` takes it up on another frontend, where the
        monotonic clock differs: its times travel as they stand against `now`)."""
        assert not self._out.events and not self._out.actions  # every outcome was taken
        fields = {k: v for k, v in vars(self).items() if k not in ("mapping", "_out")}
        fields.update(mapping=self.mapping.state(), clock=now, format=STATE_FORMAT)
        return wire.pack_state(fields, STATE_KINDS)

    @classmethod
    def restored(cls, data: bytes, mapping: RealtimeMapping, now: float) -> RealtimeSession:
        """The session whose `snapshot` this is, with `mapping` (a fresh one of its model) taking
        up its mapping's state, its times moved to this clock's `now`."""
        fields = wire.unpack_state(data, STATE_KINDS)
        if fields.pop("format", None) != STATE_FORMAT:
            raise ValueError("a session state of another layout (a frontend of another release)")
        shift = now - float(fields.pop("clock"))
        mapping.restore(fields.pop("mapping"))
        s = object.__new__(cls)
        vars(s).update(fields, mapping=mapping, _out=Out())
        s.now += shift
        if s.idle_at is not None:
            s.idle_at += shift
        if s.response is not None:
            s.response.deadline += shift
        return s


STATE_KINDS = wire.StateKinds(
    [
        SessionState,
        ResponseState,
        Response,
        SessionLimits,
        ev.TurnDetection,
        TurnSettings,
        TurnTaking,
        SpeechStarted,
        SpeechStopped,
        InputTranscript,
        ReplyStarted,
        ReplyAudio,
        ReplyText,
        ReplyEnded,
        ReplyCut,
    ],
    # A resampler's filter is native state: it travels as its rates (flushed first: `let_go`).
    {Resampler: (lambda r: [r.rate_in, r.rate_out], lambda v: Resampler(int(v[0]), int(v[1])))},
)
"""What a session's state holds besides data: its own types and the realtime mapping's."""


def _code(status: int) -> str:
    return {400: "invalid_value", 408: "session_expired", 499: "cancelled", 503: "server_busy"}.get(status, "server_error")


def _close_code(status: int) -> tuple[int, str]:
    if status == 200:
        return 1000, "session closed"
    if status == 503:
        return 1013, "try again later"
    if status == 408:  # request_timeout_s or max_call_duration_s: a limit of the server's, not a failure
        return 1008, "session expired"
    return 1011, f"the call ended ({status})"
