"""`Listener`: silero-vad turn-taking, batched across calls.

The silero JIT model's outer `forward(x, sr)` keeps one hidden state for the whole
batch in module attributes and resets it whenever the batch size changes, so it
cannot carry per-call state across steps of a changing batch. Its inner network
(`model._model`) is functional: `forward(x, state) -> (prob, new_state)` with `x` of
shape (B, 64 + 512) (64 samples of context from the previous window, then the
window) and `state` of shape (2, B, 128), and rows do not interact. So the Listener
keeps each call's state and context itself and runs one batched forward per round of
windows: round r takes every call that has an r-th ready 512-sample window this
step. Outputs match the per-call outer model to ~1e-7 (checked in the tests).

Turn decisions per call (the VADIterator rule): speech starts at the first window
with p >= `threshold`; it ends once p < `threshold - 0.15` has lasted
`min_silence_s` without p >= `threshold` in between; a turn longer than
`max_turn_s` is cut; at end of input an open turn is closed. A turn's audio runs
from `preroll_s` before its start to its end decision (trailing silence included).

A pause: once a silence has lasted `pause_s` (0.2 s) inside a turn, the step's `speech` item
says so (`"pause": true`), once per silence. The Recognizer then decodes the turn so far,
while the silence rule is still deciding; if the turn ends in that same silence (no window
at `threshold` since: the end item's `"since_pause": true`), that decode is its final, ready
when the turn ends instead of 0.1 s after it.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplexbus.sdk import CallInfo, EdgeItem, Emission, Item, Output, Partition, StepInput

SAMPLE_RATE = 16_000
WINDOW = 512  # silero-vad window at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous window the network sees
STATE_SHAPE = (2, 128)  # per call: (2, B, 128) batched
# The Listener's turn-taking defaults (its constructor's): OpenAI's server_vad defaults too.
THRESHOLD = 0.5
MIN_SILENCE_S = 0.5
PREROLL_S = 0.3
PAUSE_S = 0.2  # a silence this long inside a turn: the Recognizer decodes it ahead of the end


def load_vad_network(torch_threads: int | None = 1) -> Any:
    """The silero-vad 16 kHz network (torch JIT) from the `silero-vad` package, in eval mode.

    Importing `silero_vad` calls `torch.set_num_threads(1)` (process-wide). The network
    is tiny: a second intra-op thread makes it no faster and, on a busy 2-core machine,
    many times slower, so the Listener keeps torch at `torch_threads` (1) threads; None
    restores whatever the process had before the import.
    """
    import torch

    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # importlib.resources.path, torch.jit.load
        from silero_vad import load_silero_vad

        model = load_silero_vad(onnx=False)
    torch.set_num_threads(threads if torch_threads is None else torch_threads)
    model.eval()
    return model._model


@dataclass
class _CallState:
    pending_pcm: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))  # < WINDOW, not yet run
    state: Any = None  # torch tensor (2, 128)
    context: Any = None  # torch tensor (64,)
    samples: int = 0  # samples run through the VAD so far (stream position)
    received: int = 0  # samples received
    preroll: deque[np.ndarray] = field(default_factory=deque)  # PCM16 windows before a turn (bounded)
    turn: int = 0  # number of turns started so far (the open one is `turn`)
    triggered: bool = False
    start_at: int = 0  # sample position of the open turn's start
    temp_end: int = 0  # sample position where the current silence began (0: none)
    paused: bool = False  # the current silence has lasted pause_s
    pause_sent: bool = False  # and a `speech` item said so
    out_audio: list[np.ndarray] = field(default_factory=list)  # open turn's audio of this step
    speech_s: float = 0.0  # total voiced turn time
    ended: bool = False


class Listener(Partition):
    """VAD over `audio_in`; emits `speech` (turn audio), `vad` (events) and listen/speak outputs.

    Outputs to the client:
    - `{"type": "listen", "turn": k, "at": s}`: the caller started speaking (turn k, 1-based),
      `at` = seconds into the call's audio.
    - `{"type": "speak", "turn": k, "at": s, "speech_s": d, "end_at": e, "reason": r}`: the caller's
      turn ended; the model takes the floor. `end_at`: where the speech itself ended (the
      silence that decided the turn began there; `at - end_at` is the time the decision took,
      in the call's audio). `reason` is "silence", "max_length" or "end_of_input".
    Edge `speech` items: PCM16 int16 audio of turn k, meta `{"turn": k, "end": bool}` (the end
    item may carry no data) plus `"reason"`, `"short"` (turn shorter than `min_turn_s`) and
    `"since_pause"` on the end item, and `"pause": true` on the item that ends a step in which
    a silence reached `pause_s` (see the module's docstring).
    Edge `vad` items: meta `{"event": "speech_start" | "speech_end", "turn": k, "at": s}`.
    """

    def __init__(
        self,
        threshold: float = THRESHOLD,
        min_silence_s: float = MIN_SILENCE_S,
        preroll_s: float = PREROLL_S,
        max_turn_s: float = 30.0,
        min_turn_s: float = 0.25,
        torch_threads: int | None = 1,
        pause_s: float | None = PAUSE_S,
    ) -> None:
        import torch

        self._torch = torch
        self.net = load_vad_network(torch_threads)
        self.threshold = threshold
        self.neg_threshold = max(threshold - 0.15, 0.01)
        self.min_silence = int(min_silence_s * SAMPLE_RATE)
        # Windows kept before a turn: the fewest that cover `preroll_s` (none for 0).
        self.preroll_windows = -(-int(preroll_s * SAMPLE_RATE) // WINDOW)
        self.max_turn = int(max_turn_s * SAMPLE_RATE)
        self.min_turn = int(min_turn_s * SAMPLE_RATE)
        self.pause = int(pause_s * SAMPLE_RATE) if pause_s is not None else None
        self._calls: dict[str, _CallState] = {}

    # -- calls ---------------------------------------------------------------
    def open_call(self, call: CallInfo) -> None:
        torch = self._torch
        self._calls[call.cid] = _CallState(
            state=torch.zeros(STATE_SHAPE),
            context=torch.zeros(CONTEXT),
            preroll=deque(maxlen=self.preroll_windows),
        )

    def close_call(self, cid: str) -> dict[str, Any]:
        st = self._calls.pop(cid, None)
        if st is None:
            return {}
        return {
            "audio_in_s": round(st.received / SAMPLE_RATE, 3),
            "turns": st.turn,
            "speech_s": round(st.speech_s, 3),
        }

    # -- stepping ------------------------------------------------------------
    def step(self, batch: list[StepInput]) -> list[Emission]:
        work: list[tuple[str, _CallState, np.ndarray, np.ndarray]] = []  # cid, state, float windows, pcm windows
        for s in batch:
            st = self._calls.get(s.cid)
            if st is None or st.ended:
                continue
            chunk = s.chunks.get("audio_in")
            pcm_parts = [st.pending_pcm]
            if chunk is not None:
                for item in chunk.items:
                    if item.data is None:
                        continue
                    data = np.asarray(item.data).reshape(-1)
                    if data.dtype != np.int16:
                        data = np.clip(data, -32768, 32767).astype(np.int16)
                    pcm_parts.append(data)
            pcm = np.concatenate(pcm_parts) if len(pcm_parts) > 1 else pcm_parts[0]
            st.received += len(pcm) - len(st.pending_pcm)
            n = len(pcm) // WINDOW
            if s.inputs_ended and len(pcm) % WINDOW:
                # Pad the last partial window with silence so every sample is decided on.
                pad = WINDOW - len(pcm) % WINDOW
                pcm = np.concatenate([pcm, np.zeros(pad, dtype=np.int16)])
                n += 1
            st.pending_pcm = pcm[n * WINDOW :].copy()
            windows = pcm[: n * WINDOW].reshape(n, WINDOW)
            work.append((s.cid, st, windows.astype(np.float32) / 32768.0, windows))

        probs = self._run_vad(work)

        out: list[Emission] = []
        by_cid = {s.cid: s for s in batch}
        for (cid, st, _, pcm_windows), p in zip(work, probs, strict=True):
            for i in range(len(pcm_windows)):
                self._decide(cid, st, float(p[i]), pcm_windows[i], out)
            if by_cid[cid].inputs_ended and not st.ended:
                if st.triggered:
                    self._end_turn(cid, st, "end_of_input", out)
                st.ended = True
            self._flush_audio(cid, st, out, end_meta=None)
        return out

    def _run_vad(self, work: list[tuple[str, _CallState, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Speech probabilities of every call's windows, batched across calls round by round."""
        torch = self._torch
        probs = [np.zeros(len(w[2]), dtype=np.float32) for w in work]
        rounds = max((len(w[2]) for w in work), default=0)
        with torch.inference_mode():
            for r in range(rounds):
                rows = [i for i, w in enumerate(work) if len(w[2]) > r]
                x = torch.from_numpy(np.stack([work[i][2][r] for i in rows]))
                ctx = torch.stack([work[i][1].context for i in rows])
                state = torch.stack([work[i][1].state for i in rows], dim=1)
                xin = torch.cat([ctx, x], dim=1)
                p, new_state = self.net(xin, state)
                p = p.reshape(-1).numpy()
                for j, i in enumerate(rows):
                    st = work[i][1]
                    st.state = new_state[:, j].clone()
                    st.context = xin[j, -CONTEXT:].clone()
                    probs[i][r] = p[j]
        return probs

    def _decide(self, cid: str, st: _CallState, p: float, pcm: np.ndarray, out: list[Emission]) -> None:
        pos = st.samples  # this window's first sample
        st.samples += WINDOW
        if not st.triggered:
            if p >= self.threshold:
                st.triggered = True
                st.turn += 1
                st.start_at = pos
                st.temp_end = 0
                at = round(pos / SAMPLE_RATE, 3)
                out.append(Output(cid, {"type": "listen", "turn": st.turn, "at": at}))
                out.append(EdgeItem(cid, "vad", Item(None, {"event": "speech_start", "turn": st.turn, "at": at})))
                st.out_audio = list(st.preroll)
                st.preroll.clear()
                st.out_audio.append(pcm)
                return
            st.preroll.append(pcm)  # the deque's maxlen drops the oldest window
            return
        st.out_audio.append(pcm)
        if p >= self.threshold:
            st.temp_end = 0
            st.paused = st.pause_sent = False
        elif p < self.neg_threshold and not st.temp_end:
            st.temp_end = pos
        if st.temp_end and self.pause is not None and st.samples - st.temp_end >= self.pause:
            st.paused = True
        if st.temp_end and st.samples - st.temp_end >= self.min_silence:
            self._end_turn(cid, st, "silence", out)
        elif st.samples - st.start_at >= self.max_turn:
            self._end_turn(cid, st, "max_length", out)

    def _end_turn(self, cid: str, st: _CallState, reason: str, out: list[Emission]) -> None:
        end = st.temp_end if (st.temp_end and reason != "max_length") else st.samples
        speech = max(end - st.start_at, 0)
        st.speech_s += speech / SAMPLE_RATE
        short = speech < self.min_turn
        at = round(st.samples / SAMPLE_RATE, 3)
        # The audio after the pause item was all silence: the Recognizer's decode at the pause heard the turn.
        meta = {"turn": st.turn, "end": True, "reason": reason, "short": short, "since_pause": st.pause_sent}
        self._flush_audio(cid, st, out, end_meta=meta)
        out.append(EdgeItem(cid, "vad", Item(None, {"event": "speech_end", "turn": st.turn, "at": at})))
        out.append(
            Output(
                cid,
                {
                    "type": "speak",
                    "turn": st.turn,
                    "at": at,
                    "speech_s": round(speech / SAMPLE_RATE, 3),
                    "end_at": round(end / SAMPLE_RATE, 3),
                    "reason": reason,
                },
            )
        )
        st.triggered = False
        st.temp_end = 0
        st.paused = st.pause_sent = False

    def _flush_audio(self, cid: str, st: _CallState, out: list[Emission], end_meta: dict[str, Any] | None) -> None:
        if not st.triggered:
            return
        if not st.out_audio and end_meta is None:
            return
        data = np.concatenate(st.out_audio) if st.out_audio else None
        st.out_audio = []
        meta = end_meta if end_meta is not None else {"turn": st.turn, "end": False}
        if end_meta is None and st.paused and not st.pause_sent:
            meta["pause"] = st.pause_sent = True
        out.append(EdgeItem(cid, "speech", Item(data, meta)))
