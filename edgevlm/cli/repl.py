"""The interactive chat loop behind ``edgevlm chat`` without a prompt.

Works on a terminal and on piped stdin (scripts): one message per line, ``\"\"\"`` opens and
closes a multi-line message, ``/image PATH`` queues a picture for the next message, image paths
typed in a message are attached the way Ollama does it, ``/reset``, ``/stats``, ``/history``,
``/save PATH``, ``/load PATH``, ``/quit``. With a session file (``chat --session``) the
conversation is saved there after every turn. Ctrl-C stops the current reply, not the
session. Errors are reported on one line and the session goes on.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Callable
from typing import IO

from ..errors import EdgeVLMError
from ..runtime.engine import Clip, Engine, Sound
from ..runtime.intake import MediaRef
from ..runtime.session import recall
from ..vision.images import LoadedImage, has_image_ext

__all__ = ["ChatLoop", "extract_image_paths"]
# A path ending in an image extension: quoted, or unquoted with backslash-escaped spaces.
_PATH_RE = re.compile(r"""(?:'([^']+)'|"([^"]+)"|((?:\\ |[^\s'"])+))""", re.VERBOSE)
HELP = """commands:
  /image PATH   attach an image to the next message (repeatable)
  /video PATH   attach a video: frames chosen under the room left, each with its timestamp
  /audio PATH   attach a recording (or a video's sound): silences dropped, cut to the room left
  /reset        forget the conversation (cached image encodings are kept)
  /stats        statistics of the last reply
  /history      what the conversation holds (pictures in context or as summaries)
  /recall N     send picture N again (after it was replaced by its summary)
  /save PATH    save the conversation with its KV cache (continue it later: /load, chat --session)
  /load PATH    continue a saved conversation (this one is forgotten)
  /quit         leave (also /exit, /bye, Ctrl-D)
  \"\"\"          start or end a multi-line message
image paths typed in a message are attached too."""


def extract_image_paths(message: str) -> tuple[str, list[str]]:
    """Split image file paths that exist out of a typed message (Ollama-style)."""
    paths: list[str] = []

    def take(m: re.Match) -> str:
        raw = m.group(1) or m.group(2) or m.group(3)
        cand = os.path.expanduser(raw.replace("\\ ", " "))
        if has_image_ext(cand) and os.path.isfile(cand):
            paths.append(cand)
            return ""
        return m.group(0)

    text = _PATH_RE.sub(take, message)
    return re.sub(r"[ \t]{2,}", " ", text).strip(), paths


class ChatLoop:
    def __init__(
        self,
        engine: Engine,
        gen: dict,
        out: IO[str] = sys.stdout,
        err: IO[str] = sys.stderr,
        interactive: bool = False,
        show_stats: bool = False,
        read_line: Callable[[str], str] | None = None,
        session: str | None = None,
    ):
        self.engine = engine
        self.gen = gen
        self.out = out
        self.err = err
        self.interactive = interactive
        self.show_stats = show_stats
        self.queued: list[str | LoadedImage | MediaRef | Clip | Sound] = []  # paths, and pictures /recall brings back
        self.session = session  # saved after every turn (``chat --session``)
        self._read = read_line or self._read_stdin

    def _read_stdin(self, prompt: str) -> str:
        if self.interactive:
            return input(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def _say(self, msg: str) -> None:
        print(msg, file=self.err, flush=True)

    def read_message(self) -> str | None:
        """One message (or command); None at end of input."""
        try:
            line = self._read(">>> " if self.interactive else "")
        except EOFError:
            return None
        if line.strip() == '"""':
            lines = []
            while True:
                try:
                    more = self._read("... " if self.interactive else "")
                except EOFError:
                    break
                if more.strip() == '"""':
                    break
                lines.append(more)
            return "\n".join(lines)
        return line

    def run(self) -> int:
        if self.interactive:
            self._say("edgevlm chat — /help for commands, /quit to leave")
        while True:
            try:
                msg = self.read_message()
            except KeyboardInterrupt:
                self._say("\n(use /quit or Ctrl-D to leave)")
                continue
            if msg is None:
                if self.interactive:  # Ctrl-D: the shell's prompt on a line of its own
                    print(file=self.out, flush=True)
                return 0
            if not msg.strip():
                continue
            if msg.strip().startswith("/"):
                if self.command(msg.strip()) == "quit":
                    return 0
                continue
            self.turn(msg)

    def command(self, line: str) -> str | None:
        try:
            parts = shlex.split(line)
        except ValueError as exc:
            self._say(f"Error: {exc}")
            return None
        cmd, args = parts[0].lower(), parts[1:]
        if cmd in ("/quit", "/exit", "/bye"):
            return "quit"
        if cmd == "/help":
            self._say(HELP)
        elif cmd == "/image":
            if not args:
                self._say("Error: /image needs a path")
            for a in args:
                path = os.path.expanduser(a)
                try:
                    self.engine.load_images([path])  # validate now; cached by content hash
                except EdgeVLMError as exc:
                    self._say(f"Error: {exc}")
                    continue
                self.queued.append(path)
                self._say(f"queued {path} ({len(self.queued)} image(s) for the next message)")
        elif cmd in ("/video", "/audio"):
            kind, make = ("video", Clip) if cmd == "/video" else ("audio", Sound)
            if not args:
                self._say(f"Error: {cmd} needs a path")
            for a in args:
                path = os.path.expanduser(a)
                if not os.path.isfile(path):
                    self._say(f"Error: {path}: no such {kind} file")
                    continue
                self.queued.append(make(path, path))  # (decoded and budgeted when the message is sent)
                self._say(f"queued {path} ({len(self.queued)} item(s) for the next message)")
        elif cmd == "/reset":
            self.engine.reset()
            self.queued.clear()
            self._say("conversation reset")
        elif cmd == "/stats":
            st = self.engine.last_stats
            self._say(json.dumps(st.to_dict(), indent=2) if st else "no reply yet")
        elif cmd == "/history":
            for i, m in enumerate(self.engine.messages):
                imgs = f" [{len(m.images)} image(s)]" if m.images else ""
                text = m.text.strip().replace("\n", " ")
                self._say(f"{i + 1:3d} {m.role:9s}{imgs} {text[:70]}{'…' if len(text) > 70 else ''}")
            for p in self.engine.pictures:
                where = "in context" if p.summary is None else f"summary: {p.summary[:60]}"  # (= p.in_context)
                self._say(f"    image {p.number} ({p.name}, {p.tokens} tokens): {where}")
            self._say(f"context: {self.engine.n_ctx_used:,} / {self.engine.n_ctx:,} tokens")
        elif cmd == "/recall":
            try:
                img = recall(self.engine.conversation, int(args[0]) if args else -1)
            except (ValueError, EdgeVLMError) as exc:
                self._say(f"Error: {exc if isinstance(exc, EdgeVLMError) else '/recall needs an image number'}")
                return None
            self.queued.append(img)
            self._say(f"image {args[0]} ({img.source}) queued for the next message")
        elif cmd in ("/save", "/load"):
            if len(args) != 1:
                self._say(f"Error: {cmd} needs one path")
                return None
            path = os.path.expanduser(args[0])
            try:
                info = self.engine.save(path) if cmd == "/save" else self.engine.load(path)
            except EdgeVLMError as exc:
                self._say(f"Error: {exc}")
                return None
            if cmd == "/load":
                self.queued.clear()
                self._notices()
            self._say(f"{'saved' if cmd == '/save' else 'loaded'} {info.describe()}")
        else:
            self._say(f"Error: unknown command {cmd} (try /help)")
        return None

    def _notices(self) -> None:
        for notice in self.engine.notices:
            self._say(f"note: {notice}")
        self.engine.notices.clear()

    def turn(self, msg: str) -> None:
        text, typed = extract_image_paths(msg)
        images = self.queued + typed
        self.queued = []
        started = False
        gen = self.engine.stream(text or msg, images, **self.gen)
        try:
            for resp in gen:
                if resp.stats is None:  # (the last one's notices, a reply cut short, come after it)
                    self._notices()
                piece = resp.text
                if not started:
                    piece = piece.lstrip()
                    started = bool(piece)
                if piece:
                    self.out.write(piece)
                    self.out.flush()
        except KeyboardInterrupt:
            gen.close()
            self.out.write("\n")
            self._say("(stopped)")
            return
        except EdgeVLMError as exc:
            self._say(f"Error: {exc}")
            return
        except Exception as exc:  # a fault, not the user's input: this turn ends, the session goes on
            self._say(f"Error: internal error in this turn ({type(exc).__name__}: {exc})")
            return
        self.out.write("\n")
        self.out.flush()
        self._notices()
        if self.show_stats and self.engine.last_stats:
            self._say(self.engine.last_stats.footer())
        if self.session:
            try:
                self.engine.save(self.session)
            except EdgeVLMError as exc:
                self._say(f"Error: {exc}")
