"""A recognizer process of the gateway: ``python -m omnigate.engines.recognizer_worker``.

pocketsphinx holds the GIL while it decodes, so decoding in the gateway process would share one core with the event
loop. Each worker decodes the turns the gateway pins to it, one message at a time, with decoders it loads itself: one
at start, the next when a turn finds none idle, reused turn after turn. It reads :mod:`recognizer_wire` frames on
stdin and answers on the stdout it had (print output goes to stderr); it ends when stdin closes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from typing import BinaryIO, Protocol

from omnigate.codecs.resample import StreamResampler
from omnigate.engines.recognizer_wire import (
    HEADER,
    Drop,
    Failed,
    Fed,
    FromWorker,
    Hear,
    Heard,
    Loaded,
    body_length,
    frame,
    to_worker,
)

INPUT_RATE = 24_000  # what sessions hear, mono s16le
DECODER_RATE = 16_000  # the en-US acoustic model's
POCKETSPHINX = "omnigate.engines.recognizer_worker:PocketsphinxDecoder"


class TurnDecoder(Protocol):
    """Decodes one turn after another: :meth:`start` a turn, :meth:`feed` it 16 kHz mono s16le, :meth:`finish`."""

    def start(self) -> None:
        """Begin a turn (a turn still open is dropped)."""

    def feed(self, pcm: bytes) -> None: ...

    def finish(self) -> str:
        """End the turn; its words."""


class PocketsphinxDecoder:
    """pocketsphinx with the en-US acoustic model, language model and dictionary its wheel ships."""

    def __init__(self) -> None:
        from pocketsphinx import Decoder

        self._decoder = Decoder(loglevel="FATAL")
        self._open = False

    def start(self) -> None:
        if self._open:
            self._decoder.end_utt()
        self._decoder.start_utt()
        self._open = True

    def feed(self, pcm: bytes) -> None:
        self._decoder.process_raw(pcm, False, False)

    def finish(self) -> str:
        self._decoder.end_utt()
        self._open = False
        hypothesis = self._decoder.hyp()
        return hypothesis.hypstr if hypothesis is not None else ""


def decoder_factory(spec: str) -> Callable[[], TurnDecoder]:
    """The decoder class (or factory) named ``module:name``."""
    module, _, name = spec.partition(":")
    factory: Callable[[], TurnDecoder] = getattr(importlib.import_module(module), name)
    return factory


class Turn:
    """A turn being decoded: its decoder and the resampler its audio goes through."""

    def __init__(self, decoder: TurnDecoder) -> None:
        self.decoder = decoder
        self.resampler = StreamResampler(INPUT_RATE, DECODER_RATE)
        decoder.start()


class Worker:
    """The turns of this process (sans-I/O: :meth:`handle` one message, get the answer)."""

    def __init__(self, new_decoder: Callable[[], TurnDecoder]) -> None:
        self.new_decoder = new_decoder
        self.idle: list[TurnDecoder] = []
        self.turns: dict[int, Turn] = {}

    def load(self) -> Loaded:
        self.idle.append(self.new_decoder())
        return Loaded()

    def handle(self, message: Hear | Drop) -> FromWorker | None:
        if isinstance(message, Drop):
            turn = self.turns.pop(message.turn, None)
            if turn is not None:
                self.idle.append(turn.decoder)  # (start() ends its open utterance)
            return None
        try:
            turn = self.turns.get(message.turn) or Turn(self.idle.pop() if self.idle else self.new_decoder())
            self.turns[message.turn] = turn
            pcm = turn.resampler.process(message.pcm)
            if message.end:
                pcm += turn.resampler.flush()
            turn.decoder.feed(pcm)
            if not message.end:
                return Fed(message.turn)
            text = turn.decoder.finish()
        except Exception as error:  # its state is unknown: the decoder is not reused
            self.turns.pop(message.turn, None)
            return Failed(message.turn, f"{type(error).__name__}: {error}")
        del self.turns[message.turn]
        self.idle.append(turn.decoder)
        return Heard(message.turn, text)


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's body; None at the end of the stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    length = body_length(header)
    body = stream.read(length)
    return body if len(body) == length else None


def serve(new_decoder: Callable[[], TurnDecoder], stdin: BinaryIO, stdout: BinaryIO) -> None:
    """Decode the turns that come on ``stdin`` until it ends."""
    worker = Worker(new_decoder)
    stdout.write(frame(worker.load()))
    stdout.flush()
    while (body := read_frame(stdin)) is not None:
        answer = worker.handle(to_worker.decode(body))
        if answer is not None:
            stdout.write(frame(answer))
            stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a recognizer process of the gateway (frames on stdin/stdout)")
    parser.add_argument("--decoder", default=POCKETSPHINX, help="the decoder, module:name")
    args = parser.parse_args(argv)
    new_decoder = decoder_factory(args.decoder)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # so nothing else written to stdout breaks a frame
    with contextlib.suppress(BrokenPipeError):  # the gateway is gone
        serve(new_decoder, sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
