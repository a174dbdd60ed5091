"""`astrai chat` at a real terminal: keystrokes sent through a pseudo-terminal (pexpect) to the
command on the demo model, the conversation read back with /save and compared with the
engine's greedy replies."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pexpect
import pytest

import astrai
from astrai.inference import GenerationParams, GenerationRequest, InferenceEngine
from astrai.launch import DEMO_MODEL_DIR
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

REPO_ROOT = Path(astrai.__file__).resolve().parent.parent
UP, LEFT = "\x1b[A", "\x1b[D"
SPEED_LINE = r"\[(\d+) tokens, [\d.]+ tokens/s; first token after [\d.]+ s, \d+ prompt tokens\]"


@pytest.fixture(scope="module")
def demo_engine():
    model = AutoModel.from_pretrained(DEMO_MODEL_DIR)
    with InferenceEngine(model, AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)) as engine:
        yield engine


def spawn_chat(*flags: str) -> pexpect.spawn:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TERM": "xterm", "INPUTRC": "/dev/null"}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "astrai", "chat", "--temperature", "0", *flags],
        cwd=REPO_ROOT,
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(50, 400),
        # Patterns are matched near the end of what arrived; searching the whole of a long
        # reply after every read would take quadratic time.
        maxread=65536,
        searchwindowsize=1000,
    )
    child.expect("astrai chat with demo")
    child.expect("> ")
    return child


def replied(engine, messages: list[dict], params: GenerationParams) -> list[dict]:
    """messages and the engine's reply to them."""
    reply = engine.generate(GenerationRequest(tuple(messages), params))
    return [*messages, {"role": "assistant", "content": reply}]


def save(child: pexpect.spawn, path: Path) -> list[dict]:
    child.sendline(f"/save {path}")
    child.expect(r"\(saved \d+ messages")
    child.expect("> ")
    return json.loads(path.read_text())


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_keystrokes_commands_and_history(demo_engine, tmp_path):
    params = GenerationParams(max_tokens=8, temperature=0)
    child = spawn_chat("--max-tokens", "8")
    assert all(name in child.before for name in ("/help", "/reset", "/system", "/save", "/exit"))

    child.sendline("/help")
    child.expect("never sent to the model")
    child.expect("> ")
    assert "tokens/s" not in child.before  # /help went to no model

    # Typed with a slip, mended with the left arrow: "ello", back four, "H".
    child.send("ello" + LEFT * 4 + "H\r")
    child.expect(SPEED_LINE)
    child.expect("> ")
    child.send(UP + "\r")  # the up arrow brings "Hello" back
    child.expect(SPEED_LINE)
    child.expect("> ")
    expected = replied(demo_engine, [user("Hello")], params)
    expected = replied(demo_engine, [*expected, user("Hello")], params)
    assert save(child, tmp_path / "a.json") == expected

    child.sendline("/reset")
    child.expect("conversation forgotten")
    child.expect("> ")
    child.sendline("/system Answer in one word.")
    child.expect("system prompt set")
    child.expect("> ")
    child.sendline("two\\")  # a trailing backslash goes on to the next line
    child.expect(r"\.\.\. ")
    child.sendline("lines")
    child.expect(SPEED_LINE)
    child.expect("> ")
    child.sendline('"""three')
    child.expect(r"\.\.\. ")
    child.sendline('more"""')
    child.expect(SPEED_LINE)
    child.expect("> ")
    expected = [{"role": "system", "content": "Answer in one word."}]
    expected = replied(demo_engine, [*expected, user("two\nlines")], params)
    expected = replied(demo_engine, [*expected, user("three\nmore")], params)
    assert save(child, tmp_path / "b.json") == expected

    child.sendintr()  # Ctrl-C at an empty prompt says how to leave
    child.expect(r"to leave, press Ctrl-D or type /exit")
    child.expect("> ")
    child.sendeof()  # Ctrl-D leaves, the shell's prompt on a new line
    child.expect(pexpect.EOF)
    assert child.before == "\r\n"
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(demo_engine, tmp_path):
    """Replies of 500 tokens, long enough for Ctrl-C to cut one short."""
    params = GenerationParams(max_tokens=500, temperature=0, ignore_eos=True)
    child = spawn_chat("--max-tokens", "500", "--ignore-eos")
    child.sendline("Hello")
    child.expect(SPEED_LINE)
    assert child.match.group(1) == "500"
    child.expect("> ")

    child.sendline("Tell me more")
    child.expect("Tell me more\r\n")
    child.read_nonblocking(1)  # the reply has begun
    child.sendintr()
    child.expect(r"reply stopped")
    child.expect("> ")
    assert not re.search(SPEED_LINE, child.before)

    child.sendline("Thanks")
    child.expect(SPEED_LINE)
    child.expect("> ")
    expected = replied(demo_engine, [user("Hello")], params)
    expected = replied(demo_engine, [*expected, user("Thanks")], params)
    assert save(child, tmp_path / "chat.json") == expected
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
