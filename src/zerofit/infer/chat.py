"""``zerofit chat``'s conversation: the lines it handles itself (commands) and the turns it sends to the model.

    chat = Chat(system="Be brief.")
    run_chat(chat, answer=lambda messages, stream: ..., read=input, write=print)

A line that starts with ``/`` is a command and never reaches the model (``/help`` lists them); ``//text``
sends ``/text``. An empty line sends nothing. The end of input (Ctrl-D) ends the chat as ``/quit`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

COMMANDS = {
    "/help": "list these commands",
    "/reset": "start the conversation over (the --system message stays)",
    "/quit": "end the chat (also /exit, or Ctrl-D)",
    "/exit": "end the chat",
}
HINT = "Type a message and press Enter. /help lists the commands; /quit, /exit or Ctrl-D ends the chat."


@dataclass
class Chat:
    """The conversation so far (``messages``: the system message, then the user and assistant turns)."""

    system: str | None = None
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.messages:
            self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def fit(self, fits: Callable[[list[dict]], bool]) -> int:
        """Drop the oldest turns (a user message and the replies after it; the system message stays) until
        ``fits(messages)`` or only the last user message is left; the number of user turns dropped."""
        dropped = 0
        while not fits(self.messages):
            first = next((i for i, m in enumerate(self.messages) if m["role"] != "system"), None)
            users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
            if first is None or len(users) < 2:
                break
            del self.messages[first : users[1]]
            dropped += 1
        return dropped

    @property
    def turns(self) -> int:
        """User turns so far."""
        return sum(m["role"] == "user" for m in self.messages)


def help_text() -> str:
    rows = {**COMMANDS, "//text": "send '/text' to the model (a message that starts with '/')"}
    width = max(map(len, rows))
    return "\n".join(f"  {c:<{width}}  {what}" for c, what in rows.items())


def run_chat(
    chat: Chat,
    answer: Callable[[list[dict], Callable[[str], None]], str],
    read: Callable[[str], str],
    write: Callable[[str], None],
    fits: Callable[[list[dict]], bool] | None = None,
) -> None:
    """Read lines until /quit, /exit or the end of input. ``answer(messages, stream)`` generates the assistant's
    reply to ``messages``, passing each piece of text to ``stream``, and returns the whole text (None: no room
    for one, the message is taken back). ``read(prompt)``
    returns the next line (raising EOFError at the end); ``write(text)`` shows text (no newline added).
    ``fits(messages)``: whether a conversation and its answer fit the model's context; the oldest turns are
    left out until it does (said each time)."""
    while True:
        try:
            line = read("you> ")
        except EOFError:
            write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            word = text.split()[0].lower()
            if word in ("/quit", "/exit"):
                return
            if word == "/help":
                write(help_text() + "\n")
            elif word == "/reset":
                chat.reset()
                write("(the conversation starts over)\n")
            else:
                write(f"unknown command {word}: /help lists the commands (//{text[1:]} sends it to the model)\n")
            continue
        if text.startswith("//"):
            line = line.replace("//", "/", 1)
        chat.messages.append({"role": "user", "content": line})
        dropped = chat.fit(fits) if fits is not None else 0
        if dropped:
            write(
                f"(the {dropped} oldest turn{'s' if dropped > 1 else ''} left out: the conversation passed the "
                "model's context)\n"
            )
        write("model> ")
        reply = answer(chat.messages, write)
        if reply is None:  # the message alone leaves no room for an answer
            chat.messages.pop()
            write("(not sent: the message is longer than the model's context)\n")
            continue
        write("\n")
        chat.messages.append({"role": "assistant", "content": reply})
