"""The pure core of one eval sample: its stages, what ends a stage, the drain decision and
the retry rules. No I/O and no clock of its own: the runner passes the time in.

A sample goes connect -> handshake -> input -> commit -> drain -> close. Every wait is
bounded (`Bounds`). What a failed stage means is decided here (`decide`), so each rule is
one line and is tested with hand-made inputs:

- a transport stall or an early close (the server stopped answering, or went away) is
  retried once, on a new connection;
- an error the server sent (any status, 5xx included; a model error, a failed response) is
  never retried: a 4xx or a model error would fail the same way again, and a 503 or 500
  says what state the deployment is in, which the eval counts rather than hides;
- a close that stalls after a completed reply publishes the sample as completed (the
  reply is all there; only the goodbye was lost);
- an input or commit stall is retried once even under a completed reply: a reply does not
  prove that the input arrived (a model may answer the first half of a clip);
- an exception in the client's own code fails the sample at once with its traceback: it
  is a bug to see, never a timeout to retry.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.runtime.states import checked
from shared.runtime.stats import turn_latency


class Stage(enum.Enum):
    CONNECT = "connect"
    HANDSHAKE = "handshake"
    INPUT = "input"
    COMMIT = "commit"
    DRAIN = "drain"
    CLOSE = "close"
    DONE = "done"


_NEXT: dict[Stage, frozenset[Stage]] = {
    Stage.CONNECT: frozenset({Stage.HANDSHAKE}),
    Stage.HANDSHAKE: frozenset({Stage.INPUT}),
    Stage.INPUT: frozenset({Stage.COMMIT}),
    Stage.COMMIT: frozenset({Stage.DRAIN}),
    Stage.DRAIN: frozenset({Stage.CLOSE}),
    Stage.CLOSE: frozenset({Stage.DONE}),
    Stage.DONE: frozenset(),
}


class Failure(enum.Enum):
    STALL = "stall"  # a bounded wait ran out: the server stopped answering or reading
    CLOSED = "closed"  # the connection went away (or was refused) without a server error
    SERVER_ERROR = "server_error"  # the server said no: an error event or an HTTP status (5xx too), a model error
    CLIENT_ERROR = "client_error"  # an exception in this client's own code


TRANSPORT = frozenset({Failure.STALL, Failure.CLOSED})


class Verdict(enum.Enum):
    RETRY = "retry"
    FAIL = "fail"
    COMPLETED = "completed"


MAX_RETRIES = 1


def decide(stage: Stage, failure: Failure, reply_completed: bool, retries: int) -> Verdict:
    """What a failure at `stage` makes of the sample (see the module docstring)."""
    if failure not in TRANSPORT:
        return Verdict.FAIL  # a server error fails the same way again; a client bug is to be seen
    if stage is Stage.CLOSE and reply_completed:
        return Verdict.COMPLETED
    return Verdict.RETRY if retries < MAX_RETRIES else Verdict.FAIL


@dataclass(frozen=True)
class Bounds:
    """Every wait of a sample, in seconds."""

    connect_s: float = 10.0
    handshake_s: float = 10.0
    input_slack_s: float = 10.0  # the input stream may take the clip's duration plus this
    commit_s: float = 10.0
    drain_s: float = 60.0  # from the end of input to the reply's drain
    quiet_s: float = 5.0  # no reply activity this long (and no reply open): drained
    close_s: float = 5.0  # the inner close (the server's goodbye)
    close_grace_s: float = 2.0  # the outer close wait is close_s + this, so the inner one can finish

    def input_bound(self, clip_s: float) -> float:
        return clip_s + self.input_slack_s

    def close_bounds(self) -> tuple[float, float]:
        """(inner, outer): the outer wait outlasts the inner one, which then reports its own end."""
        return self.close_s, self.close_s + self.close_grace_s


class Kind(enum.Enum):
    """What an incoming message is, for the drain decision and the record."""

    REPLY_START = "reply_start"  # a response was created (it is open until REPLY_END)
    REPLY_AUDIO = "reply_audio"
    REPLY_TEXT = "reply_text"
    REPLY_END = "reply_end"
    LISTEN = "listen"  # the model acknowledges input (speech started, committed, a transcript): not a reply
    TURN_END = "turn_end"  # the model decided the caller's turn ended (speak, speech_stopped): not a reply
    TRANSCRIPT = "transcript"  # the model's transcript of the input (final): not a reply
    COMMITTED = "committed"  # the server took the end of input
    SESSION = "session"  # handshake events
    TERMINAL = "terminal"  # the call ended (generate-ws `finish`): nothing more will come
    ERROR = "error"  # the server refused something
    OTHER = "other"


REPLY_ACTIVITY = frozenset({Kind.REPLY_START, Kind.REPLY_AUDIO, Kind.REPLY_TEXT, Kind.REPLY_END})


@dataclass
class Event:
    kind: Kind
    name: str = ""  # the protocol's own name for it (`response.done`, `reply_end`, ...)
    audio: bytes = b""  # PCM16 LE of REPLY_AUDIO
    rate: int = 0
    text: str = ""
    code: str = ""  # ERROR: the server's code or status
    failed: bool = False  # REPLY_END of a response the server says failed (a model error)
    call_id: str = ""  # TERMINAL / SESSION: the server's id of the call or session
    waited_s: float | None = None  # TURN_END, REPLY_END: end of speech to the turn decision, as the model says


@dataclass
class Drain:
    """The drain decision: the reply has drained once the input has ended, no response is
    open, and either the call ended or a quiet window has passed without reply activity.

    Listen acknowledgements never count as activity: a model that answers each padding
    append with "still listening" must still drain, and one that answers a clip with
    listening only drains a quiet window after the end of input."""

    quiet_s: float
    ended_at: float | None = None  # end of input
    last_activity: float | None = None
    open_replies: int = 0
    replies_done: int = 0
    terminal: bool = False

    def end_of_input(self, now: float) -> None:
        self.ended_at = now

    def on_event(self, ev: Event, now: float) -> None:
        if ev.kind in REPLY_ACTIVITY:
            self.last_activity = now
        if ev.kind is Kind.REPLY_START:
            self.open_replies += 1
        elif ev.kind is Kind.REPLY_END:
            self.open_replies = max(0, self.open_replies - 1)
            self.replies_done += 1
        elif ev.kind is Kind.TERMINAL:
            self.terminal = True
            self.open_replies = 0

    @property
    def reply_completed(self) -> bool:
        """The reply is all there: the call ended, or every response that opened has closed."""
        return self.terminal or (self.replies_done > 0 and self.open_replies == 0)

    def quiet_since(self) -> float | None:
        if self.ended_at is None:
            return None
        return max(self.ended_at, self.last_activity or self.ended_at)

    def drained(self, now: float) -> bool:
        if self.terminal:
            return True
        since = self.quiet_since()
        return since is not None and self.open_replies == 0 and now - since >= self.quiet_s

    def wake_at(self) -> float | None:
        """When `drained` may next turn true with no event arriving (None: only an event can)."""
        since = self.quiet_since()
        if since is None or self.open_replies:
            return None
        return since + self.quiet_s


class Progress:
    """The stage a sample is in, with guarded transitions."""

    def __init__(self) -> None:
        self.stage = Stage.CONNECT

    def to(self, stage: Stage) -> None:
        self.stage = checked("eval sample", self.stage, stage, _NEXT)


@dataclass
class Timeline:
    """What happened when (seconds on the runner's monotonic clock); the record is computed from it."""

    opened: float = 0.0
    stage_started: dict[str, float] = field(default_factory=dict)
    stage_took: dict[str, float] = field(default_factory=dict)
    input_started: float | None = None
    input_ended: float | None = None  # the end of input was sent
    committed: float | None = None  # the server acknowledged it
    padding_appends: int = 0
    audio_at: list[float] = field(default_factory=list)  # arrival of each reply audio chunk
    audio_s: list[float] = field(default_factory=list)  # its duration
    first_reply_at: float | None = None  # first reply activity of any kind
    last_reply_at: float | None = None
    listen_acks: int = 0
    turn_ended_at: float | None = None  # the model decided the (first) turn ended
    turn_waited_s: float | None = None  # end of speech to that decision, in the call's audio (the model's figure)
    transcript_at: float | None = None  # the first final transcript

    def enter(self, stage: Stage, now: float) -> None:
        self.stage_started[stage.value] = now

    def leave(self, stage: Stage, now: float) -> None:
        self.stage_took[stage.value] = now - self.stage_started.get(stage.value, now)

    def on_event(self, ev: Event, now: float) -> None:
        if ev.kind in REPLY_ACTIVITY:
            if self.first_reply_at is None:
                self.first_reply_at = now
            self.last_reply_at = now
        if ev.kind is Kind.REPLY_AUDIO and ev.rate > 0:
            self.audio_at.append(now)
            self.audio_s.append(len(ev.audio) / 2 / ev.rate)
        elif ev.kind in (Kind.LISTEN, Kind.TURN_END):
            self.listen_acks += 1
        if ev.kind is Kind.TURN_END and self.turn_ended_at is None:
            self.turn_ended_at = now
        elif ev.kind is Kind.TRANSCRIPT and self.transcript_at is None:
            self.transcript_at = now
        if ev.waited_s is not None and self.turn_waited_s is None:
            self.turn_waited_s = ev.waited_s


@dataclass(frozen=True)
class Figures:
    """Per-sample latency figures (seconds); None where the sample had no such thing."""

    ttfa_s: float | None  # end of input -> first reply audio that arrived after it
    reply_latency_s: float | None  # end of input -> the reply's last activity
    reply_audio_s: float
    rtf: float | None  # first -> last reply audio arrival over the reply's audio duration
    gaps_s: list[float]  # between consecutive reply audio arrivals
    # The turn, where the model decides it (voice_assistant; server VAD): end of speech to
    # the decision (the model's own figure), the decision to the final transcript, and end of
    # speech to the first reply audio (the model's figure plus what the client waited after
    # the decision; from the decision alone where the model gives no figure).
    end_of_turn_s: float | None = None
    transcript_s: float | None = None
    first_audio_s: float | None = None


def turn_figures(t: Timeline) -> tuple[float | None, float | None, float | None]:
    """(end_of_turn_s, transcript_s, first_audio_s) of Figures."""
    decided = t.turn_ended_at
    if decided is None:
        return t.turn_waited_s, None, None
    first_audio = next((a for a in t.audio_at if a >= decided), None)
    return turn_latency(decided, t.turn_waited_s, t.transcript_at, first_audio)


def figures(t: Timeline) -> Figures:
    end = t.input_ended
    after = [a for a in t.audio_at if end is not None and a >= end]
    ttfa = after[0] - end if after and end is not None else None
    latency = t.last_reply_at - end if t.last_reply_at is not None and end is not None and t.last_reply_at >= end else None
    audio_s = sum(t.audio_s)
    rtf = (t.audio_at[-1] - t.audio_at[0]) / audio_s if len(t.audio_at) > 1 and audio_s > 0 else None
    gaps = [b - a for a, b in zip(t.audio_at, t.audio_at[1:], strict=False)]
    return Figures(ttfa, latency, audio_s, rtf, gaps, *turn_figures(t))
