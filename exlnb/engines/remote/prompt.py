"""What the server is sent for a job's prompt: exlnb's rendered text, or the chat messages behind it.

The session hands every engine token ids (`JobSpec.input_ids`), rendered by exlnb's templates. With
`api="completions"` the server gets that text as it is, so exlnb's own templates (and their mistakes, field
report 4) reach the model. With `api="chat"` the server applies its own chat template, so it must be sent the
messages: `RemoteTokenizer` remembers the messages behind each rendering of the model's template (`template="auto"`)
and `chat_prompt` finds them again by the ids. A prompt rendered by another template is refused there, since the
server would wrap it in its template a second time; one with no special tokens at all (a load test's filler)
goes as one user message.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from exlnb.engines.options import SERVER_APIS
from exlnb.engines.tokenizer import HfTokenizer

REMEMBERED_RENDERINGS = 256  # the latest renderings kept: a chat's next turn is rendered again anyway

PATHS = {"chat": "/chat/completions", "completions": "/completions"}  # each of SERVER_APIS under the API base
assert set(PATHS) == set(SERVER_APIS), "a server API without its path"


class RemoteTokenizer(HfTokenizer):
    """The served model's tokenizer, read locally: token counts, stop ids and templates mean what they mean on the
    other engines. It remembers the messages behind each chat-template rendering, for `api="chat"`."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self._messages: OrderedDict[tuple[int, ...], list[dict[str, str]]] = OrderedDict()

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        text = super().apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        if add_generation_prompt:
            self._messages[tuple(self.encode(text, special=True))] = [dict(m) for m in messages]
            while len(self._messages) > REMEMBERED_RENDERINGS:
                self._messages.popitem(last=False)
        return text

    def messages_for(self, ids: tuple[int, ...]) -> list[dict[str, str]] | None:
        return self._messages.get(ids)


def prompt_field(tokenizer: RemoteTokenizer, api: str, ids: tuple[int, ...]) -> dict:
    """{"prompt": text} for /v1/completions, {"messages": [...]} for /v1/chat/completions; ValueError where a
    chat server would get a prompt already wrapped in a template."""
    text = tokenizer.decode(ids, special=True)
    if api == "completions":
        return {"prompt": text}
    messages = tokenizer.messages_for(tuple(ids))
    if messages is not None:
        return {"messages": messages}
    specials = [s for s in tokenizer.special_tokens() if s and s in text]
    if specials:
        raise ValueError(
            f"the prompt is already rendered with a template (it holds {specials[0]!r}), and with api='chat' the "
            "server applies its own: use template='auto', or load with api='completions' to send exlnb's rendering"
        )
    return {"messages": [{"role": "user", "content": text}]}
