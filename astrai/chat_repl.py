"""`astrai chat`'s loop: read a message, stream the model's reply, keep the conversation.

At a terminal it behaves as llama.cpp's and Ollama's chats do: line editing and history
(readline), commands that never reach the model, Ctrl-C that stops only the reply, Ctrl-D that
leaves, and a tokens/s line after each reply. Read from a pipe, it prints the replies alone,
one a line, so its output can be compared or processed.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from astrai.inference.engine import GenerationRequest, InferenceEngine, SyncRequestStream
from astrai.inference.task import GenerationParams, RequestError
from astrai.model.vision.decode import ImageError, ImageLimits, decode_image
from astrai.tokenize import ChatTemplateError

PROMPT = "> "
CONTINUATION = "... "
BLOCK_QUOTES = '"""'
EXIT_HINT = "(to leave, press Ctrl-D or type /exit)"

HELP = f"""\
Commands (never sent to the model):
  /help          this list
  /reset         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt for the rest of the conversation; /system alone removes it
  /save FILE     write the conversation to FILE as JSON messages ({{"role", "content"}})
  /image FILE    show the model an image (PNG, JPEG, WebP, GIF) with your next message
                 (vision-language models)
  /exit          leave (also /quit, or Ctrl-D)
Several lines: end a line with \\ to go on with the next one, or start the message with \
{BLOCK_QUOTES} and end it with {BLOCK_QUOTES}.
Ctrl-C stops a reply: that message and its cut reply are left out of the conversation (the up
arrow brings the message back). The line after a reply gives its tokens per second: the tokens
after the first over the time from the first to the last (decode only), and the time to the
first token (the prompt's processing).\
"""


class ChatSession:
    """One conversation with the engine: its messages and the commands that change them."""

    def __init__(
        self,
        engine: InferenceEngine,
        params: GenerationParams,
        model_name: str,
        *,
        interactive: bool,
        out: TextIO = sys.stdout,
    ) -> None:
        self.engine = engine
        self.params = params
        self.model_name = model_name
        self.interactive = interactive
        self.out = out
        self.system: str | None = None
        self.messages: list[dict] = []
        # Images /image attached to the next message: its content parts, each with its file.
        self.images: list[dict] = []
        if interactive:
            # Importing readline gives input() line editing and history; a Python built
            # without it still reads plain lines.
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401

    def conversation(self) -> list[dict]:
        """The messages the model sees, the system prompt first."""
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        return system + self.messages

    def run(self) -> int:
        """Read and answer messages until /exit or end of input; returns the exit status."""
        if self.interactive:
            self._say(
                f"astrai chat with {self.model_name}. Commands: /help /reset /system TEXT "
                "/save FILE /image FILE /exit.\nCtrl-C stops a reply, Ctrl-D leaves; end a line "
                f"with \\ (or wrap the text in {BLOCK_QUOTES}) to write several lines."
            )
        while True:
            try:
                text = self.read_message()
            except KeyboardInterrupt:
                if not self.interactive:
                    raise
                self._say(f"\n{EXIT_HINT}")
                continue
            except EOFError:
                if self.interactive:
                    self._say("")  # the shell's prompt starts on a line of its own
                return 0
            if not text.strip():
                continue
            if text.startswith("/"):
                if not self.command(text.strip()):
                    return 0
                continue
            self.reply(text)

    def read_message(self) -> str:
        """One message: a line, lines joined by a trailing backslash, or a triple-quoted block.

        Raises EOFError at end of input and KeyboardInterrupt on Ctrl-C.
        """
        text = self._input(PROMPT)
        if text.lstrip().startswith(BLOCK_QUOTES):
            text = text.lstrip()[len(BLOCK_QUOTES) :]
            lines = [text]
            while not lines[-1].rstrip().endswith(BLOCK_QUOTES):
                lines.append(self._input(CONTINUATION))
            lines[-1] = lines[-1].rstrip()[: -len(BLOCK_QUOTES)]
            return "\n".join(lines).strip("\n")
        while text.endswith("\\"):
            text = text[:-1] + "\n" + self._input(CONTINUATION)
        return text

    def command(self, line: str) -> bool:
        """Run one /command; False means leave."""
        name, _, argument = line.partition(" ")
        argument = argument.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self._say(HELP)
        elif name == "/reset":
            self.messages.clear()
            self.images.clear()
            kept = "; the system prompt stays" if self.system is not None else ""
            self._note(f"(conversation forgotten{kept})")
        elif name == "/system":
            self.system = argument or None
            self._note("(system prompt set)" if argument else "(system prompt removed)")
        elif name == "/save":
            self.save(argument)
        elif name == "/image":
            self.attach_image(argument)
        else:
            self._error(f"unknown command {name}; /help lists the commands")
        return True

    def attach_image(self, path: str) -> None:
        """Read the image at path for the next message, within the engine's image limits."""
        if not path:
            self._error("/image needs a file name: /image FILE")
            return
        if self.engine.model.vision is None:
            self._error("/image needs a vision-language model; this one reads text only")
            return
        config = self.engine.config
        try:
            data = Path(path).read_bytes()
            image = decode_image(
                data, ImageLimits(config.max_image_bytes, config.max_image_pixels), path
            )
        except OSError as exc:
            self._error(f"cannot read {path}: {exc.strerror}")
            return
        except ImageError as exc:
            self._error(str(exc))
            return
        self.images.append({"type": "image", "image": image, "file": path})
        self._note(f"(image {path} goes with your next message)")

    def save(self, path: str) -> None:
        if not path:
            self._error("/save needs a file name: /save FILE")
            return
        try:
            with open(path, "w", encoding="utf-8") as file:
                json.dump(_saved(self.conversation()), file, ensure_ascii=False, indent=2)
                file.write("\n")
        except OSError as exc:
            self._error(f"cannot save the conversation: {exc}")
            return
        self._note(f"(saved {len(self.conversation())} messages to {path})")

    def reply(self, text: str) -> None:
        """Stream the model's answer to text; Ctrl-C aborts it and drops the exchange."""
        content = [*self.images, {"type": "text", "text": text}] if self.images else text
        self.images = []
        self.messages.append({"role": "user", "content": content})
        try:
            request = GenerationRequest(tuple(self.conversation()), self.params)
            stream = SyncRequestStream(self.engine, [self.engine.encode(request)], self.params)
        except (RequestError, ChatTemplateError) as exc:
            self.messages.pop()
            self._error(f"{exc}; type /reset to start over")
            return
        start = time.perf_counter()
        first = result = None
        try:
            for event in stream:
                if event.result is not None:
                    result = event.result
                    continue
                first = first or time.perf_counter()
                self.out.write(event.delta.text)
                self.out.flush()
        except KeyboardInterrupt:
            stream.close()  # aborts the task: the engine stops generating and frees its pages
            self.messages.pop()
            self.out.write("\n")
            self._note("(reply stopped; it and your message are left out of the conversation)")
            return
        end = time.perf_counter()
        self.out.write("\n")
        try:
            result.raise_for_status()
        except RuntimeError as exc:
            self.messages.pop()
            self._error(str(exc))
            return
        self.messages.append({"role": "assistant", "content": result.text})
        self._note(_speed_line(result.completion_tokens, result.prompt_tokens, start, first, end))

    def _input(self, prompt: str) -> str:
        return input(prompt if self.interactive else "")

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _note(self, text: str) -> None:
        """Say text at a terminal; from a pipe, stdout holds the replies alone."""
        if self.interactive:
            self._say(text)

    def _error(self, text: str) -> None:
        self.out.flush()
        print(f"astrai: {text}", file=sys.stderr, flush=True)


def _saved(messages: list[dict]) -> list[dict]:
    """The messages as JSON holds them: an image part names its file."""
    return [
        {
            **message,
            "content": message["content"]
            if isinstance(message["content"], str)
            else [
                {"type": "image", "file": part["file"]} if part["type"] == "image" else part
                for part in message["content"]
            ],
        }
        for message in messages
    ]


def _speed_line(tokens: int, prompt_tokens: int, start: float, first: float | None, end: float):
    """[N tokens, R tokens/s; first token after S s, P prompt tokens]: R counts the tokens after
    the first over the time from the first to the last, as llama.cpp's eval time and Ollama's
    eval rate leave the prompt's processing out."""
    parts = [f"{tokens} tokens"]
    if first is not None and tokens > 1 and end > first:
        parts[0] += f", {(tokens - 1) / (end - first):.1f} tokens/s"
    if first is not None:
        parts.append(f"first token after {first - start:.2f} s, {prompt_tokens} prompt tokens")
    return f"[{'; '.join(parts)}]"
