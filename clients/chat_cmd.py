"""`coalesce chat`: an interactive, multi-turn conversation with the served model, replies streamed.

Ctrl-C while a reply streams cancels that reply on the server (its exchange is dropped from the conversation)
and returns to the prompt; Ctrl-C at the prompt clears the line. Ctrl-D or /exit quits, /reset starts over.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import uuid
from collections.abc import Callable
from typing import TextIO

from clients.client import CoalesceClient
from clients.command_error import CommandError
from clients.generate_cmd import describe
from clients.types import CoalesceError, GenerateOptions, tls_of

HELP = "Ctrl-C cancels a reply; Ctrl-D or /exit quits; /reset starts a new conversation."


class Chat:
    """The conversation so far and one turn at a time against a client."""

    def __init__(self, client: CoalesceClient, options: GenerateOptions, system: str | None, out: TextIO) -> None:
        self.client, self.options, self.out = client, options, out
        self.opening = [("system", system)] if system else []
        self.messages = list(self.opening)

    def loop(self, read: Callable[[str], str] = input) -> None:
        while True:
            try:
                line = read("you> ")
            except EOFError:
                self.out.write("\n")
                return
            except KeyboardInterrupt:
                self.out.write("\n")
                continue
            command = line.strip()
            if not command:
                continue
            if command in ("/exit", "/quit"):
                return
            if command == "/reset":
                self.messages = list(self.opening)
                self.out.write("(new conversation)\n")
                continue
            self.turn(line)

    def turn(self, text: str) -> str | None:
        """Send one user message and stream the reply; the reply, or None when cancelled or failed."""
        self.messages.append(("user", text))
        # Our own request id: Ctrl-C can cancel on the server even before the first chunk arrived.
        request_id = uuid.uuid4().hex
        options = self.options.copy()
        options["stream"], options["request_id"] = True, request_id
        gen = self.client.chat(self.messages, **options)
        parts: list[str] = []
        self.out.write("model> ")
        self.out.flush()
        try:
            for chunk in gen:
                parts.append(chunk.text)
                self.out.write(chunk.text)
                self.out.flush()
        except KeyboardInterrupt:
            gen.close()
            with contextlib.suppress(CoalesceError):  # already gone: nothing left to stop
                self.client.cancel(request_id)
            self.out.write(" [cancelled]\n")
            self.messages.pop()
            return None
        except CoalesceError as err:
            self.out.write("\n")
            print(f"error: {describe(err, self.client.address)}", file=sys.stderr, flush=True)
            self.messages.pop()
            return None
        self.out.write("\n")
        reply = "".join(parts)
        self.messages.append(("assistant", reply))
        return reply


def run(args: argparse.Namespace) -> None:
    # Ctrl-C is this command's cancel key, even when it was started with SIGINT ignored (a background job of a
    # non-interactive shell ignores it, and Python then installs no KeyboardInterrupt handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    options: GenerateOptions = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    with CoalesceClient(args.address, args.token, tls=tls_of(args)) as client:
        try:
            info = client.model_info()
        except CoalesceError as err:
            raise CommandError(describe(err, args.address)) from None
        print(f"chatting with {info.model} ({info.dtype}) at {args.address}. {HELP}", flush=True)
        Chat(client, options, args.system, sys.stdout).loop()
